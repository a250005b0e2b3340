"""The plan of a run, kept up to date while it trains: the warm-up that measures α and may move
tables to AllReduce (the hybrid's rule), the decision on local aggregation, the partition-count
search, and ``parallax plan``'s early exit. A step hook: `after_step` after every step.

It owns the tables' placement: `repartition` (the partition search's and the user's) and the
move of a table to AllReduce go through it, so the plan it prints is always the layout that
trains.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from parallax.cluster import WorkerInfo
from parallax.config import Config, DenseSyncName
from parallax.engine.optimizers.shard_optimizer import ShardOptimizer, optimizer_of
from parallax.engine.tables.columns import column_slices
from parallax.engine.tables.layout import Layout
from parallax.engine.tables.own import OwnTable
from parallax.engine.tables.sharding import POOLED, POOLED_BY_ROWS
from parallax.engine.tables.table import Table
from parallax.errors import PlanComplete
from parallax.logs import log
from parallax.model.detect import SparseUse
from parallax.model.stand_ins import RetracedRoot, TableLookup
from parallax.parallelism import Parallelism
from parallax.partitions.repartition import repartition, to_column_slices
from parallax.partitions.tuner import PartitionTuner, SearchRecord, build_tuner
from parallax.planning import link
from parallax.planning.architectures import (
    ONE_WORKER,
    Architecture,
    largest_first,
    pool_the_rest,
)
from parallax.planning.memory import free_bytes, state_tensors_per_parameter
from parallax.planning.plan import Plan
from parallax.planning.sparsity import OWN, Sparsity, measure, move_to_allreduce, own_table_chosen
from parallax.session import shutdown
from parallax.step.aggregation_trial import AggregationTrial
from parallax.step.hooks import StepDone
from parallax.step.sync_modes import SyncMode

__all__ = ["PlanKeeper"]


class PlanKeeper:
    """``warmup_steps``: steps before α is measured (0: never); ``plan_only``: under
    ``parallax plan``, the path to write the plan to ("" to print only), then end the
    program; None when training."""

    def __init__(self, model: nn.Module, sparse_uses: dict[str, SparseUse], layout: Layout, *,
                 architecture: Architecture, config: Config, worker: WorkerInfo,
                 group: dist.ProcessGroup, sync_mode: SyncMode, warmup_steps: int,
                 plan_only: str | None) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.sparse_uses = sparse_uses
        self.layout = layout
        self.architecture = architecture
        self.config = config
        self.worker = worker
        self.group = group
        self.sync_mode = sync_mode
        self.warmup_steps = warmup_steps
        self.plan_only = plan_only
        #: whether the program's own code sees gradients (`parallax.distribute`'s loop); set
        #: by the runner
        self.program_sees_grads: Callable[[], bool] = lambda: False
        #: whether sparse exchanges go through each machine's leader (the hybrid may turn it
        #: off once α is measured: `Architecture.keeps_local_aggregation`)
        self.local_aggregation = architecture.aggregates_locally(config)
        self.sparsity: dict[str, Sparsity] = {}
        #: the link the plan's times assume: given, or measured after the warm-up
        self.link = None if config.link_gbit is None else link.given(config.link_gbit)
        self.decisions: dict[str, str] = (
            dict.fromkeys(sparse_uses, "lazy: touched rows only")
            if config.lazy_sparse_updates else {})
        for name, table in layout.sparse.items():
            # (pinned by the program: their own word in the plan, where their bags are pooled)
            pin = config.pinned_sharding(name)
            if table.sharding.pools and pin is not None:
                self.decisions[name] = (
                    f"{table.sharding.describe(layout.placement(name).servers)} "
                    f"(Config.{pin[1]})")
        #: the shapes of `Runner.step`'s batch (what a search's cache entry is valid for)
        self.batch_signature: Any = None
        self.tuner: PartitionTuner | None = None
        #: the timed choice of the leader hop, where the architecture's rule kept it
        self.trial: AggregationTrial | None = None
        self._hop_tables: list[Table] = []
        self._completed = warmup_steps == 0  # the warm-up's decisions are taken
        if warmup_steps == 0:  # α is never measured here
            self._stop_measuring()
        self.build()

    def attach(self, executed: nn.Module, optimizers: Sequence[torch.optim.Optimizer],
               shard_optimizer: ShardOptimizer, replicated: list[nn.Parameter],
               parallelism: Parallelism, threads: int,
               completed: Callable[[], None] = lambda: None) -> None:
        """The training machinery, once built: what the warm-up rewires when a table moves,
        the partition search's tuner, and ``completed``, called once the warm-up's decisions
        are applied (what runs may follow them)."""
        self.completed = completed
        self.executed = executed
        self.optimizers = optimizers
        self.shard_optimizer = shard_optimizer
        self.replicated = replicated
        self.parallelism = parallelism
        steps = self.config.local_aggregation_trial_steps
        if (self.sync_mode.aligned and steps and self.architecture.tries_local_aggregation
                and self.config.local_aggregation is None):
            self.trial = AggregationTrial(self._switch_hop, steps=steps, group=self.group,
                                          device=self.worker.device)
        if self.sync_mode.aligned:  # its timed samples need aligned steps
            self.tuner = build_tuner(
                self.model, self.layout.sparse, config=self.config, worker=self.worker,
                local_aggregation=self.local_aggregation, threads=threads, group=self.group,
                device=self.worker.device, repartition=self.repartition)

    @property
    def searches(self) -> dict[str, SearchRecord]:
        """Per partition group, how its count was chosen (`Runner.partition_searches`)."""
        return {} if self.tuner is None else dict(self.tuner.records)

    def build(self) -> None:
        """The plan of the layout as it is now."""
        self.plan = Plan.build(self.model, self.sparse_uses, placements=self.layout.placements,
                               world_size=self.worker.world_size,
                               num_machines=len(self.worker.server_ranks),
                               architecture=self.config.architecture, sparsity=self.sparsity,
                               small_sums=self.worker.device.type == "cpu",
                               flat_dense=self.config.dense_sync == DenseSyncName.FLAT,
                               shardings={n: t.sharding
                                          for n, t in self.layout.all_tables().items()},
                               reasons=self.decisions,
                               local_aggregation=self.local_aggregation,
                               searches=tuple(self.searches.values()), link=self.link)

    # ---- the step hook -----------------------------------------------------------------------
    @property
    def settled(self) -> bool:
        """Whether the plan is final: α measured, the leader hop's trial and any partition
        search done (a benchmark's timed steps start after)."""
        return self._completed and not ((self.trial is not None and self.trial.active)
                                        or (self.tuner is not None and self.tuner.active))

    def after_step(self, done: StepDone) -> None:
        """Feed the trial or the search its step time; complete the plan after the
        warm-up."""
        if self.tuner is not None and self.tuner.active:
            self.tuner.after_step(done.seconds)
            if not self.tuner.active:
                if self._completed:  # (α measured: the hop's decision is taken)
                    self._begin_trial()
                self.build()
                self._exit_if_plan_only()
        elif self.trial is not None and self.trial.active:
            self.trial.after_step(done.seconds)
            if not self.trial.active:
                self._trial_done()
        if done.steps_here == self.warmup_steps:
            self._complete()
        elif self.warmup_steps == 0 and done.steps_here == 1:
            self._start_search()

    def _complete(self) -> None:
        """After the warm-up steps: measure α; pool on owners the bag tables the architecture
        says pool cheapest (`Architecture.pools_bags`), then decide on the leader hop for the
        tables still pulling rows, and move to AllReduce what is cheaper there (the hybrid's
        rule: `Architecture.moves_to_allreduce`; collective)."""
        self._completed = True
        tables = self.layout.sparse
        self.sparsity = measure(tables, self.worker, self.group, self.worker.device)
        if self.link is None:
            self.link = link.measure(self.worker, self.group)
        self._stop_measuring()
        self._pool_bags()
        self._decide_local_aggregation()
        self.sync_mode.after_warmup(self.group)
        for name, table in list(tables.items()):
            move, why = self.architecture.moves_to_allreduce(
                table, self.sparsity[name], config=self.config, worker=self.worker)
            if move and not self.sync_mode.aligned:
                self.decisions[name] = (f"stays on the servers (sync="
                                        f"{str(self.config.sync)!r}); {why}")
                move = False
            held = table.held
            if (move and why == ONE_WORKER and self.program_sees_grads() and held is not None
                    and not own_table_chosen(self.params[name], self.optimizers,
                                             device=self.worker.device, world_size=1,
                                             sparse_grad=held.sparse_grad,
                                             batch_dependent=held.batch_dependent)):
                # the own loop may read .grad, so a replica's would be a whole zero-filled
                # table each step, slower than the servers' rows (the program's own table
                # is the plain one: its gradient is autograd's, as on one device)
                self.decisions[name] = ("stays on the servers (one worker, the program's own "
                                        "loop, a large table whose untouched rows do not move: "
                                        "the servers step the touched ones)")
                move = False
            if not move or held is None:  # (replicated tables are there already)
                continue
            moved = move_to_allreduce(held, self.params[name], list(self.optimizers),
                                      self.shard_optimizer, worker=self.worker, group=self.group)
            self._replace_table(table, moved)
            self.replicated.append(self.params[name])
            self.decisions[name] = OWN if type(moved) is OwnTable else why
        self._start_search()
        if self.tuner is None or not self.tuner.active:  # else once the search is done
            self._begin_trial()
        self.build()
        self._exit_if_plan_only()
        self.completed()

    # ---- the leader hop's trial --------------------------------------------------------------
    def _begin_trial(self) -> None:
        """Start timing the hop where the rule kept it for some server-held table (after
        the partition search, whose samples ran with the hop)."""
        self._hop_tables = [t for t in self.layout.sparse.values()
                            if t.on_servers and not t.sharding.pools and t.local_aggregation]
        if (self.trial is not None and self.local_aggregation and self._hop_tables
                and self.plan_only is None):  # (parallax plan shows the bytes rule's choice)
            self.trial.begin()

    def _switch_hop(self, on: bool) -> None:
        for table in self._hop_tables:
            table.local_aggregation = on
        self.local_aggregation = on

    def _trial_done(self) -> None:
        assert self.trial is not None
        why = self.trial.summary()
        for name, table in self.layout.sparse.items():
            if any(table is hop for hop in self._hop_tables) and name in self.sparse_uses:
                rule = self.decisions.get(name)  # the bytes rule's reason, kept before it
                self.decisions[name] = f"{rule}; {why}" if rule else why
        log.info("parallax: %s", why)
        self.build()
        self._exit_if_plan_only()

    def _pool_bags(self) -> None:
        """Hold whole on one server, and pool there, the bag tables the architecture says
        pool cheaper (`Architecture.pools_bags`; collective): largest first, each onto the
        server holding the fewest pooled bytes so far (a table no server holds whole spread
        over several where that saves bytes: `_pool_spread`). Then, where all of them pool,
        the other server-held tables too if that leaves no table pulling rows
        (`_pooled_with_them`), in the room left."""
        servers = self.worker.server_ranks
        load = [0] * len(servers)
        for name, table in self.layout.sparse.items():
            if table.sharding.pools and len(self.layout.placement(name).servers) == 1:
                load[servers.index(self.layout.placement(name).servers[0])] += \
                    self.params[name].nbytes
        chosen = {}
        for name, table in self.layout.sparse.items():
            use = self.sparse_uses.get(name)
            if use is None or table.held is None:
                continue
            pool, why = self.architecture.pools_bags(table, use, self.sparsity[name],
                                                     config=self.config, worker=self.worker)
            if pool:
                chosen[name] = why
        if not chosen:
            return
        room = self._room_on_servers()
        self._place(chosen, room, load, spread=True)
        if all(self.layout.sparse[name].sharding.pools for name in chosen):
            self._place(self._pooled_with_them(chosen), room, load, spread=False)

    def _place(self, chosen: dict[str, str], room: dict[int, float], load: list[int], *,
               spread: bool) -> None:
        """Pool the ``chosen`` tables (name: why) whole on the servers with ``room`` for them,
        largest first onto the least ``load``; one that fits none is spread where
        ``spread`` (`_pool_spread`), else keeps its rows. Takes from ``room``, adds to
        ``load``."""
        servers = self.worker.server_ranks
        needed = {name: self._bytes_held_whole(name) for name in chosen}
        most_free: dict[str, float] = {}

        def fits(name: str, server: int) -> bool:  # and takes the room when it does
            most_free[name] = max(most_free.get(name, 0.0), room[server])
            if needed[name] > room[server]:
                return False
            room[server] -= needed[name]
            return True

        owners = largest_first({name: self.params[name].nbytes for name in chosen}, load,
                               fits=fits)
        for name, why in chosen.items():
            held = self.layout.sparse[name].held
            if held is None:
                continue
            if name not in owners:
                too_large = (f"{why}, but held whole on one server it would take "
                             f"{needed[name]:,} B with its gradient and optimizer state, and "
                             f"at most {most_free[name]:,.0f} B are free on any")
                if spread:
                    self._pool_spread(name, too_large, needed[name], room, load)
                else:
                    self.decisions[name] = f"{too_large}: its rows stay partitioned"
                continue
            owner = owners[name]
            repartition(held, 1, self.shard_optimizer, first_server=owner)
            held.sharding, held.local_aggregation = POOLED, False
            self.layout.placements[name] = self.layout.placement(name)._replace(
                partitions=1, servers=(servers[owner],))
            self.decisions[name] = f"{why}; owner rank {servers[owner]}"

    def _pool_spread(self, name: str, too_large: str, needed: int, room: dict[int, float],
                     load: list[int]) -> None:
        """Pool ``name``, too large for one server, spread over several where that saves
        bytes: by rows (the rows stay where they are, every server pools its share) or as
        column slices (each slice moved onto its own server, which must have room for its
        share of ``needed``), whichever the bytes model predicts cheaper; else its rows stay
        partitioned. Takes the slices' room from ``room`` and adds their bytes to ``load``."""
        held = self.layout.sparse[name].held
        assert held is not None
        servers = self.worker.server_ranks
        by_rows, rows_why = self._by_rows(name)
        slices = column_slices(math.prod(held.row_shape), len(servers))
        first = min(range(len(servers)), key=lambda s: (load[s], s))
        on = [(first + k) % len(servers) for k in range(slices)]
        by_columns, columns_why = (
            self.architecture.pools_by_columns(held, self.sparse_uses[name],
                                               self.sparsity[name], config=self.config,
                                               worker=self.worker, slices=slices)
            if all(needed / slices <= room[s] for s in on) else (None, ""))
        if by_columns is not None and (by_rows is None or by_columns < by_rows):
            to_column_slices(held, slices, self.shard_optimizer, first_server=first)
            held.local_aggregation = False
            for s in on:
                room[s] -= needed / slices
                load[s] += self.params[name].nbytes // slices
            self.layout.placements[name] = self.layout.placement(name)._replace(
                partitions=slices, servers=tuple(servers[s] for s in on))
            self.decisions[name] = f"{too_large}: {columns_why}"
        elif by_rows is not None:
            held.sharding = POOLED_BY_ROWS
            held.local_aggregation = False
            self.decisions[name] = f"{too_large}: {rows_why}"
        else:
            self.decisions[name] = f"{too_large}: its rows stay partitioned"

    def _by_rows(self, name: str) -> tuple[float | None, str]:
        """``name``'s predicted bytes pooled by rows where that saves bytes
        (`Architecture.pools_by_rows`; else None): not a layer whose ``mode`` is ``"max"``
        (the shares are sums; an ``nn.Embedding``'s bags are sums or means)."""
        use = self.sparse_uses[name]
        layer = (self.model.get_submodule(use.module_path) if use.module_path is not None
                 else None)
        if getattr(layer, "mode", "sum") not in ("sum", "mean"):
            return None, ""
        return self.architecture.pools_by_rows(self.layout.sparse[name], use,
                                               self.sparsity[name], config=self.config,
                                               worker=self.worker)

    def _pooled_with_them(self, chosen: dict[str, str]) -> dict[str, str]:
        """The other server-held tables, with why, where pooling them too leaves no table
        pulling rows (`pool_the_rest`); none otherwise."""
        rest: dict[str, tuple[float, float] | None] = {}
        for name, table in self.layout.sparse.items():
            if name in chosen or table.sharding.pools or table.held is None or not table.on_servers:
                continue
            use = self.sparse_uses.get(name)
            rest[name] = None if use is None else self.architecture.pooling_bytes(
                table, use, self.sparsity[name], config=self.config, worker=self.worker)
        take, why = pool_the_rest(rest)
        return dict.fromkeys(rest, why) if take else {}

    def _room_on_servers(self) -> dict[int, float]:
        """Per server (an index into the server ranks), the bytes the least free of all
        processes may still allocate (`free_bytes`; one MIN all-reduce for all servers:
        every rank decides alike)."""
        workers = max(1, self.worker.world_size // len(self.worker.server_ranks))
        mine = free_bytes(workers)
        if self.worker.device.type == "cuda":  # the shard lives in the GPU's memory
            mine = min(mine, torch.cuda.mem_get_info(self.worker.device)[0])
        free = torch.tensor([min(mine, 2.0**62)], dtype=torch.float64,
                            device=self.worker.device)
        dist.all_reduce(free, op=dist.ReduceOp.MIN, group=self.group)
        return dict.fromkeys(range(len(self.worker.server_ranks)), float(free))

    def _bytes_held_whole(self, name: str) -> int:
        """What holding parameter ``name`` whole takes: its values, a gradient and the
        per-row state its optimizer keeps (`state_tensors_per_parameter`)."""
        param = self.params[name]
        owner = optimizer_of(list(self.optimizers), param)
        states = state_tensors_per_parameter(owner) if owner is not None else 0
        return param.nbytes * (2 + states)

    def _decide_local_aggregation(self) -> None:
        """Keep or drop the leader hop as the architecture says for the measured α and α_m
        (the same answer on every rank: both are all-reduced)."""
        if not self.local_aggregation:
            return
        keep, why = self.architecture.keeps_local_aggregation(
            self.layout.sparse, self.sparsity, config=self.config, worker=self.worker)
        self.local_aggregation = keep
        for name, table in self.layout.all_tables().items():
            if table.on_servers and not table.sharding.pools:  # (a pooled table talks to its owner)
                table.local_aggregation = table.local_aggregation and keep
                if name in self.sparse_uses and why:
                    self.decisions[name] = why

    def _stop_measuring(self) -> None:
        """α is measured (or never will be): the tables stop counting their use."""
        for table in self.layout.sparse.values():
            table.measuring = False

    def _replace_table(self, old: Table, new: Table) -> None:
        new.measuring = old.measuring
        self.layout.replace(new)
        for module in self.executed.modules():
            if isinstance(module, TableLookup) and module.table is old:
                module.table = new
        if isinstance(self.executed, RetracedRoot):  # (its other traces' stand-ins: old)
            self.executed.forget_other_traces()

    # ---- the partition search ----------------------------------------------------------------
    def _start_search(self) -> None:
        if self.tuner is None:
            return
        self.tuner.groups_on_servers({name for name, table in self.layout.sparse.items()
                                      if table.on_servers and not table.sharding.pools})
        self.tuner.begin(self.batch_signature)
        self.build()

    def repartition(self, num_partitions: int, names: Iterable[str] | None = None) -> None:
        """Split the server-held sparse tables (all, or those in ``names``) into
        ``num_partitions`` partitions each, keeping values and optimizer state (collective)."""
        self.sync_mode.require_aligned(
            "re-partitioning", "not implemented (the servers' threads hold the partitions); "
                               "set Config.num_partitions before training")
        wanted = None if names is None else set(names)
        for name, table in self.layout.sparse.items():
            held = table.held
            if held is None or table.sharding.pools or (wanted is not None and name not in wanted):
                continue  # (a pooled table is whole on its owner)
            if held.partitioning.num_partitions == num_partitions:
                continue
            repartition(held, num_partitions, self.shard_optimizer)
            self.layout.repartitioned(name, num_partitions)
        self.build()

    # ---- parallax plan -----------------------------------------------------------------------
    def _exit_if_plan_only(self) -> None:
        """Under ``parallax plan``, stop once α is measured and any search is done: the plan
        is printed and written, then `PlanComplete` (a `SystemExit` with status 0) ends the
        program."""
        if self.plan_only is None or not self.settled:
            return
        if self.worker.rank == 0:
            print("\n" + self.plan.table(), flush=True)  # below any progress bar
            if self.parallelism.grid.model > 1:
                print(self.parallelism.describe(), flush=True)
            if self.plan_only:
                Path(self.plan_only).write_text(self.plan.to_json())
        dist.barrier(group=self.group)
        shutdown()
        raise PlanComplete(self.plan_only or "the plan is printed")
