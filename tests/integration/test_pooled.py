"""Owner-side pooling (`Config.pooled_tables`, `Config.pooled_by_rows`,
`parallax.engine.tables.pooled`).

On 2 machines x 2 workers (tests/scripts/pooled_worker.py): EmbeddingBag tables pooled on their
owners train to the single-device parameters (float64, every bag option the owner reproduces,
dense and sparse gradients, SGD with momentum and clipping, Adagrad, Adam), each table on its
own owner as the plan says, with fewer inter-machine bytes than pulling the rows; a checkpoint
written halfway resumes in one process to the same parameters. In one process:
what cannot be pooled exactly is refused, naming the parameter and the rank."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import parallax
from parallax.checkpoint.export import export, export_state_dict
from parallax.errors import SparseIdError, UnsupportedProgramError

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import pooled_cases as cases  # noqa: E402

WORKER = ROOT / "tests" / "scripts" / "pooled_worker.py"


def _run(out: Path, machines: int, per_machine: int) -> None:
    cmd = [sys.executable, "-m", "parallax.cli", "run", "--machines", str(machines),
           "--nproc-per-machine", str(per_machine), str(WORKER), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("pooled")
    _run(out, 2, 2)
    return torch.load(out / "train.pt"), out / "ckpt"


def _max_error(got: dict[str, Tensor], want: dict[str, Tensor]) -> float:
    assert got.keys() == want.keys()  # (the reference is on the CPU; a run may be on CUDA)
    return max(float((got[k].cpu() - want[k].cpu()).abs().max()) for k in want)


@pytest.mark.parametrize("case", cases.CASES, ids=lambda c: c.name)
def test_pooled_tables_train_to_the_single_device_parameters(runs, case) -> None:
    trained, _ = runs
    want = cases.single_device(case)
    initial = cases.build(case)[0].state_dict()
    assert _max_error(trained[case.name]["state"], want) <= 1e-9
    assert _max_error(want, initial) > 1e-2  # the case trains (its tables move)


def test_each_pooled_table_lives_whole_on_its_own_owner_as_the_plan_says(runs) -> None:
    plan = runs[0][cases.RESUMED]["plan"]
    lines = {line.split()[0]: line for line in plan.splitlines()[1:] if line.strip()}
    # the larger table first onto server rank 0, the other onto the other machine's server
    assert "bags pooled on owner rank 0" in lines["history.weight"]
    assert "PS: 1 partition(s) on server rank(s) 0" in lines["history.weight"]
    assert "bags pooled on owner rank 2" in lines["user.weight"]
    assert "PS: 1 partition(s) on server rank(s) 2" in lines["user.weight"]
    # the items' nn.Embedding, not named in Config.pooled_tables, pulls its rows
    assert "bags pooled" not in lines["item.weight"]
    assert "PS: 2 partition(s) on server rank(s) 0,2" in lines["item.weight"]


def test_a_table_pooled_by_rows_stays_partitioned_over_the_servers_as_the_plan_says(
        runs) -> None:
    trained, _ = runs
    plan = _plan_rows(trained["by-rows-sum-weights-adagrad"]["plan"])
    for name in ("history.weight", "item.weight"):  # (the items' nn.Embedding rows too)
        assert "bags pooled by rows, each server rank of 0,2 its rows' share" in " ".join(
            plan[name]), plan[name]
    assert "PS: 2 partition(s) on server rank(s) 0,2" in plan["history.weight"]
    assert "bags pooled on owner rank" in " ".join(plan["user.weight"])
    moved = trained["by-rows-sum-weights-adagrad"]["bytes"]["history.weight"]
    assert moved["inter_sent"] > 0 and moved["inter_received"] > 0


def test_an_own_loop_trains_column_slices_to_the_single_device_parameters(runs) -> None:
    """`parallax.distribute` on 2 x 2, both bag tables as 2 column slices, every worker's
    slice of a step in two backwards: the single-device parameters."""
    trained, _ = runs
    case = next(c for c in cases.CASES if c.name == cases.RESUMED_BY_COLUMNS)
    state = trained[f"own loop: {case.name}"]["state"]
    assert _max_error(state, cases.single_device(case)) <= 1e-9


def test_a_table_pooled_by_columns_is_sliced_over_the_servers_as_the_plan_says(runs) -> None:
    """Width 6 over 2 servers: 2 slices of 3 columns, one on each; its bags' ids go to both,
    its pooled rows come back as two halves (the bytes each way counted)."""
    trained, _ = runs
    plan = _plan_rows(trained["by-columns-sum-weights-momentum-clip"]["plan"])
    assert ("bags pooled by columns: 2 slices, on server ranks 0,2 "
            "(Config.pooled_by_columns)") in " ".join(plan["history.weight"])
    assert "PS: 2 partition(s) on server rank(s) 0,2" in plan["history.weight"]
    assert "bags pooled on owner rank" in " ".join(plan["user.weight"])
    # α: the program's rows its bags read (the same batches as the case pooled whole)
    assert plan["history.weight"][4] == _plan_rows(trained[cases.RESUMED]["plan"])[
        "history.weight"][4]
    moved = trained["by-columns-sum-weights-momentum-clip"]["bytes"]["history.weight"]
    assert moved["inter_sent"] > 0 and moved["inter_received"] > 0


def test_pooling_moves_fewer_bytes_across_machines_than_pulling_rows(runs) -> None:
    trained, _ = runs
    pooled, pulled = trained[cases.RESUMED]["bytes"], trained["rows-pulled"]["bytes"]
    for name in cases.POOLED:  # rank 0's bytes over the same steps and data
        inter = {run: sum(v for k, v in moved[name].items() if k.startswith("inter"))
                 for run, moved in (("pooled", pooled), ("pulled", pulled))}
        assert 0 < inter["pooled"] < 0.6 * inter["pulled"], (name, inter)


def test_left_to_the_planner_a_table_is_pooled_where_it_saves_bytes(runs) -> None:
    """(the floor of rows' bytes lowered to 1,500 B for these tiny tables): the history's
    bags move fewer bytes pooled than its rows; the user bags' rows move less than the floor,
    but with the items' rows only averaged over pairs (bags an owner pools too) pooling both
    leaves no table pulling rows: they are pooled with the history's."""
    lines = _plan_rows(runs[0]["planner-decides"]["plan"])
    assert re.search(r"bags pooled on an owner: predicted [\d,]+ B vs rows [\d,]+ B, "
                     r"AllReduce [\d,]+ B per step; owner rank 0", lines["history.weight"][5])
    assert lines["history.weight"][6] == "PS: 1 partition(s) on server rank(s) 0"
    for name in ("user.weight", "item.weight"):
        assert "bags pooled with the other tables'" in lines[name][5], lines[name]
        assert lines[name][6] == "PS: 1 partition(s) on server rank(s) 2", lines[name]


def test_a_max_bag_table_no_server_holds_whole_is_cut_into_column_slices(runs) -> None:
    """(every process told it has 30,000 B free): the history's bags pool cheaper than its
    rows, but whole it takes 43,200 B and a max is no sum of shares: the planner cuts it into
    2 column slices of 21,600 B, one on each server, and it trains on exactly (see
    test_pooled_tables_train_to_the_single_device_parameters)."""
    lines = _plan_rows(runs[0]["planner-cuts-columns"]["plan"])
    assert re.search(r"would take 43,200 B with its gradient and optimizer state, and at most "
                     r"30,000 B are free on any: pooled by columns instead, 2 slices on their "
                     r"own servers: predicted [\d,]+ B vs rows [\d,]+ B per step",
                     lines["history.weight"][5]), lines["history.weight"][5]
    assert lines["history.weight"][6] == "PS: 2 partition(s) on server rank(s) 0,2"


def _plan_rows(plan: str) -> dict[str, list[str]]:
    return {cells[0]: cells for line in plan.splitlines()[3:]
            if len(cells := re.split(r"\s{2,}", line.strip())) > 7}


def test_the_plan_predicts_pooling_s_bytes_and_offers_it_for_pulled_bags(runs) -> None:
    trained, _ = runs
    pooled = _plan_rows(trained[cases.RESUMED]["plan"])
    pulled = _plan_rows(trained["rows-pulled"]["plan"])
    hybrid = pooled["history.weight"].index("PS: 1 partition(s) on server rank(s) 0") + 1
    for name in cases.POOLED:
        offered = re.search(r"pooled on an owner: (.*?)/step", pulled[name][5])
        assert offered is not None, pulled[name]
        assert offered.group(1) == pooled[name][hybrid]  # what pinning it then predicts
        assert _bytes(pooled[name][hybrid]) < _bytes(pulled[name][hybrid])
    # the items' nn.Embedding rows are only averaged over pairs: their bags are offered too
    assert "pooled on an owner: " in pulled["item.weight"][5]


def _bytes(text: str) -> float:
    value, unit = text.split()
    return float(value) * {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}[unit]


@pytest.mark.usefixtures("_shutdown")
@pytest.mark.parametrize("name, folder", [(cases.RESUMED, "ckpt"),
                                          (cases.RESUMED_BY_ROWS, "ckpt-by-rows"),
                                          (cases.RESUMED_BY_COLUMNS, "ckpt-by-columns")])
def test_a_checkpoint_resumes_on_another_shape(runs, name: str, folder: str) -> None:
    """Saved halfway by 4 workers on 2 machines, resumed by this one process (by rows: one
    server, so one share: the owner pools the whole call; by columns: saved as 2 column
    slices, resumed as one, the whole rows)."""
    _, checkpoint = runs
    case = next(c for c in cases.CASES if c.name == name)
    model, optimizer = cases.build(case)
    runner = parallax.get_runner(model, optimizer, cases.loss_fn, config=parallax.Config(
        pooled_tables=case.pooled, pooled_by_rows=case.by_rows,
        pooled_by_columns=case.by_columns, sparsity_warmup_steps=2, partition_cache=None))
    runner.load(checkpoint.parent / folder)
    if case.by_columns:  # the checkpoint's rows are column slices: exported whole
        loaded = runner.state_dict()
        exported = export(checkpoint.parent / folder, checkpoint.parent / f"{folder}.pt")
        for state in (export_state_dict(checkpoint.parent / folder), torch.load(exported)):
            assert _max_error(state, loaded) == 0
    for batch in cases.batches(case)[case.steps // 2:]:
        runner.step(cases.worker_slice(case, batch, 0, 1))
    assert _max_error(runner.state_dict(), cases.single_device(case)) <= 1e-9


# ---- refused, in one process -----------------------------------------------------------------
class Bags(nn.Module):
    def __init__(self, **options) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(20, 3, mode="sum", **options)
        self.embedding = nn.Embedding(20, 3)
        self.out = nn.Linear(3, 2)

    def forward(self, ids: Tensor, weights: Tensor | None = None) -> Tensor:
        return self.out(self.bag(ids, per_sample_weights=weights)
                        + self.embedding(ids.clamp(max=19)).mean(dim=1))


def _runner(model: nn.Module, pooled: tuple[str, ...], **config) -> parallax.Runner:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return parallax.get_runner(model, optimizer, lambda o, t: F.cross_entropy(o, t),
                               config=parallax.Config(pooled_tables=pooled, **config))


@pytest.fixture
def _shutdown():
    yield
    parallax.shutdown()


@pytest.mark.usefixtures("_shutdown")
@pytest.mark.parametrize("field, name, message", [
    ("pooled_tables", "nope.weight", r"'nope.weight', which is not a sparse parameter; it "
                                     r"takes .* whose rows the program only sums or averages "
                                     r".*\['bag.weight', 'embedding.weight'\]"),
])
def test_a_name_that_is_no_poolable_table_is_refused(field: str, name: str,
                                                     message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _runner(Bags(), () if field != "pooled_tables" else (name,), **(
            {field: (name,)} if field != "pooled_tables" else {}))


@pytest.mark.usefixtures("_shutdown")
def test_a_bag_with_max_norm_is_refused() -> None:
    with pytest.raises(UnsupportedProgramError, match=r"'bag.weight', whose layer has "
                                                      r"max_norm=1.0"):
        _runner(Bags(max_norm=1.0), ("bag.weight",))


@pytest.mark.parametrize("config, why", [
    ({"architecture": "allreduce"}, "architecture='allreduce'"),
    ({"sync": "async-sparse"}, "sync='async-sparse'"),
    ({"pooled_tables": "bag.weight"}, "a tuple of distinct parameter names"),
])
def test_configurations_that_cannot_pool_are_refused(config: dict, why: str) -> None:
    with pytest.raises(ValueError, match=rf"pooled_tables.*{why}"):
        parallax.Config(**{"pooled_tables": ("bag.weight",), **config})


@pytest.mark.parametrize("config, why", [
    ({"pooled_by_rows": ("bag.weight",), "pooled_tables": ("bag.weight",)},
     "none of them in pooled_tables"),
    ({"pooled_by_rows": "bag.weight"}, "a tuple of distinct parameter names"),
    ({"pooled_by_rows": ("bag.weight",), "architecture": "allreduce"},
     "architecture='allreduce'"),
])
def test_configurations_that_cannot_pool_by_rows_are_refused(config: dict, why: str) -> None:
    with pytest.raises(ValueError, match=rf"pooled_by_rows.*{why}"):
        parallax.Config(**config)


@pytest.mark.parametrize("config, why", [
    ({"pooled_by_columns": ("bag.weight",), "pooled_tables": ("bag.weight",)},
     "none of them in pooled_tables or pooled_by_rows"),
    ({"pooled_by_columns": ("bag.weight",), "pooled_by_rows": ("bag.weight",)},
     "none of them in pooled_tables or pooled_by_rows"),
    ({"pooled_by_columns": ("bag.weight", "bag.weight")}, "a tuple of distinct parameter"),
    ({"pooled_by_columns": ("bag.weight",), "sync": "async-sparse"}, "sync='async-sparse'"),
])
def test_configurations_that_cannot_pool_by_columns_are_refused(config: dict,
                                                                why: str) -> None:
    with pytest.raises(ValueError, match=rf"pooled_by_columns.*{why}"):
        parallax.Config(**config)


@pytest.mark.usefixtures("_shutdown")
@pytest.mark.parametrize("field", ["pooled_by_rows", "pooled_by_columns"])
def test_a_name_pooled_by_rows_or_columns_that_is_no_table_is_refused(field: str) -> None:
    with pytest.raises(ValueError, match=rf"Config.{field} names 'out.weight', which is not "
                                         r"a sparse parameter"):
        _runner(Bags(), (), **{field: ("out.weight",)})


@pytest.mark.usefixtures("_shutdown")
def test_a_max_bag_pooled_by_rows_is_refused_when_the_runner_is_built() -> None:
    class MaxBags(Bags):
        def __init__(self) -> None:
            super().__init__()
            self.bag = nn.EmbeddingBag(20, 3, mode="max")

    with pytest.raises(UnsupportedProgramError, match=r"pooled_by_rows names 'bag.weight', "
                                                      r"whose nn.EmbeddingBag has mode='max'"):
        _runner(MaxBags(), (), pooled_by_rows=("bag.weight",))


@pytest.mark.usefixtures("_shutdown")
def test_weights_that_need_a_gradient_and_bad_ids_are_refused_naming_the_rank() -> None:
    runner = _runner(Bags(), ("bag.weight",))
    ids, target = torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([0, 1])
    runner.step(((ids, torch.rand(2, 3)), target))  # detached weights pool
    with pytest.raises(UnsupportedProgramError, match=r"rank 0: parameter 'bag.weight' is "
                                                      r"pooled .* require a gradient"):
        runner.step(((ids, torch.rand(2, 3, requires_grad=True)), target))
    with pytest.raises(SparseIdError, match=r"'bag.weight' got id 20 on rank 0"):
        runner.forward((torch.tensor([[1, 20]]),))


@pytest.mark.usefixtures("_shutdown")
def test_an_own_loop_accumulating_two_backwards_per_step_trains_exactly() -> None:
    """`parallax.distribute`: each half of the batch pooled and backpropagated on its own,
    the owner's gradients summed over both before the optimizer's step."""
    case = next(c for c in cases.CASES if c.mode == "max")
    model, optimizer = cases.build(case)
    model, optimizer = parallax.distribute(model, optimizer, config=parallax.Config(
        pooled_tables=case.pooled, partition_cache=None))
    for batch in cases.batches(case):
        optimizer.zero_grad()
        for half in range(2):
            args, targets = cases.worker_slice(case, batch, half, 2)
            (cases.loss_fn(model(*args), targets) / 2).backward()
        optimizer.step()
    assert _max_error(model.state_dict(), cases.single_device(case)) <= 1e-9


@pytest.mark.usefixtures("_shutdown")
def test_a_forward_pools_all_its_bag_calls_in_one_exchange(monkeypatch) -> None:
    """The id program computes both tables' calls (ids, offsets, weights) from the inputs:
    one exchange before the forward pools them all; a call it cannot foresee pools alone."""
    from parallax.engine.tables import pooled

    exchanges: list[list[str]] = []
    real = pooled.pool_many

    def counted(calls):
        exchanges.append([call.table.name for call in calls])
        return real(calls)

    monkeypatch.setattr(pooled, "pool_many", counted)
    case = next(c for c in cases.CASES if c.weights)
    model, optimizer = cases.build(case)
    runner = parallax.get_runner(model, optimizer, cases.loss_fn, config=parallax.Config(
        pooled_tables=case.pooled, partition_cache=None))
    batch = cases.batches(case)[0]
    runner.step(cases.worker_slice(case, batch, 0, 1))
    assert exchanges == [["history.weight", "user.weight"]]
    exchanges.clear()
    args, _ = cases.worker_slice(case, batch, 0, 1)
    ids, offsets, weights = (a.to(runner.device) for a in args[:3])  # as the step moves them
    runner._executed.history(ids, offsets, per_sample_weights=weights)  # called on its own
    assert exchanges == [["history.weight"]]


@pytest.mark.usefixtures("_shutdown")
@pytest.mark.parametrize("offsets, mode, weights, message", [
    ([1, 2], "sum", False, r"offsets\[0\] has to be 0"),
    ([0, 9], "sum", False, r"offsets\[-1\] can not be greater than input's length 6"),
    ([0, 4, 2], "sum", False, "offsets must not decrease"),
    ([0, 3], "mean", True, "per_sample_weights is only supported for mode='sum'"),
])
def test_a_call_torch_refuses_is_refused_before_any_exchange(offsets, mode, weights,
                                                             message) -> None:
    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bag = nn.EmbeddingBag(20, 3, mode=mode)

        def forward(self, ids: Tensor, offsets: Tensor, w: Tensor | None = None) -> Tensor:
            return self.bag(ids, offsets, per_sample_weights=w)

    runner = _runner(Flat(), ("bag.weight",))
    ids = torch.arange(6)
    args = (ids, torch.tensor(offsets), torch.rand(6) if weights else None)
    with pytest.raises(ValueError, match=r"rank 0: the call of 'bag.weight''s nn.EmbeddingBag "
                                         rf"is one torch refuses on one device: .*{message}"):
        runner.forward(args)


@pytest.mark.usefixtures("_shutdown")
@pytest.mark.parametrize("free, by_rows, pooled", [(40_000, False, "no"),
                                                   (40_000, True, "by rows"),
                                                   (2**32, True, "whole")])
def test_the_planner_pools_a_table_whole_only_where_it_fits_one_server(
        monkeypatch, free, by_rows, pooled) -> None:
    """(one process: the bytes rules are stood in for, the memory rule is the one at test)
    A table the planner would pool stays partitioned when, whole on one server with its
    gradient and optimizer state, it would not fit in what that server may still allocate;
    there it is pooled by rows where that saves bytes, and trains on exactly."""
    from parallax.planning import architectures
    from parallax.step import plan_keeper

    monkeypatch.setattr(architectures.Hybrid, "pools_bags",
                        lambda self, table, use, measured, **_: (use.kind == "embedding_bag",
                                                                 "pooling saves bytes"))
    monkeypatch.setattr(architectures.Hybrid, "pools_by_rows",
                        lambda self, table, use, measured, **_: (1.0 if by_rows else None,
                                                                 "by rows saves too"))
    monkeypatch.setattr(plan_keeper, "free_bytes", lambda processes: free)
    case = next(c for c in cases.CASES if c.name == "planner-decides")
    model, optimizer = cases.build(case)
    runner = parallax.get_runner(model, optimizer, cases.loss_fn, config=parallax.Config(
        partition_cache=None, sparsity_warmup_steps=1, num_partitions=2,
        alpha_threshold=1.0))  # the tables not pooled stay on the servers at one worker
    for batch in cases.batches(case):
        runner.step(cases.worker_slice(case, batch, 0, 1))
    lines = _plan_rows(runner.plan.table())
    # 300 x 6 float64 values, their gradient and Adagrad's sum: 3 x 14,400 B
    too_large = (r"pooling saves bytes, but held whole on one server it would take 43,200 B "
                 r"with its gradient and optimizer state, and at most 40,000 B are free on any")
    if pooled == "whole":
        assert lines["history.weight"][6] == "PS: 1 partition(s) on server rank(s) 0"
        assert "pooling saves bytes; owner rank 0" in lines["history.weight"][5]
    elif pooled == "by rows":
        assert lines["history.weight"][6] == "PS: 2 partition(s) on server rank(s) 0"
        assert re.search(rf"{too_large}: by rows saves too", lines["history.weight"][5])
        assert runner.layout.sparse["history.weight"].held.sharding.by_rows
    else:
        assert lines["history.weight"][6] == "PS: 2 partition(s) on server rank(s) 0"
        assert re.search(rf"{too_large}: its rows stay partitioned", lines["history.weight"][5])
    assert _max_error(runner.state_dict(), cases.single_device(case)) <= 1e-9


@pytest.mark.usefixtures("_shutdown")
def test_a_pooled_exchange_sends_its_ids_with_its_header_once_the_rooms_hold(
        monkeypatch) -> None:
    """The header and the ids go in one all_to_all where the rooms reserved from earlier
    exchanges hold them: the first exchange (no room yet) needs a second one, a later
    exchange of the same calls does not; the pooled rows come back in one more."""
    from parallax.engine.tables import exchange, pooled

    inside, sent = [False], []
    real_all_to_all, real_pool = exchange.all_to_all, pooled.pool_many  # (one rank: copies)

    def counted(*args, **kwargs):
        sent.append(inside[0])
        return real_all_to_all(*args, **kwargs)

    def pooling(calls):
        inside[0] = True
        try:
            return real_pool(calls)
        finally:
            inside[0] = False

    case = next(c for c in cases.CASES if not c.weights and c.pooled)
    model, optimizer = cases.build(case)
    runner = parallax.get_runner(model, optimizer, cases.loss_fn, config=parallax.Config(
        pooled_tables=case.pooled, partition_cache=None))
    batch = cases.worker_slice(case, cases.batches(case)[0], 0, 1)
    real_start = exchange.Hop._start

    def counted_start(self, payloads, send, receive, *, async_op):  # type: ignore[no-untyped-def]
        # a hop's send is one exchange however it is made (a group of one copies, without
        # an all_to_all)
        sent.append(inside[0])
        with monkeypatch.context() as within:
            within.setattr(exchange, "all_to_all", real_all_to_all)
            return real_start(self, payloads, send, receive, async_op=async_op)

    for module in list(sys.modules.values()):  # every module that imported it by name
        if getattr(module, "all_to_all", None) is real_all_to_all:
            monkeypatch.setattr(module, "all_to_all", counted)
    monkeypatch.setattr(exchange.Hop, "_start", counted_start)
    monkeypatch.setattr(pooled, "pool_many", pooling)
    per_step = []
    for _ in range(3):
        sent.clear()
        runner.step(batch)
        per_step.append(sum(sent))
    assert per_step == [3, 2, 2]


class _AllBags(torch.nn.Module):
    """Long history bags and one-id user bags: every table can pool."""

    def __init__(self) -> None:
        super().__init__()
        self.history = torch.nn.EmbeddingBag(300, 6, mode="mean")
        self.user = torch.nn.EmbeddingBag(50, 6, mode="sum")
        self.out = torch.nn.Linear(12, 3)

    def forward(self, history: torch.Tensor, users: torch.Tensor) -> torch.Tensor:
        return self.out(torch.cat([self.history(history), self.user(users)], dim=1))


class _TokenRows(_AllBags):
    """The same bags beside an nn.Embedding whose rows are read one by one: it cannot pool."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = torch.nn.Embedding(40, 3)
        self.out = torch.nn.Linear(15, 3)

    def forward(self, history: torch.Tensor, users: torch.Tensor) -> torch.Tensor:
        first = self.tokens(users % 40)[:, 0]
        return self.out(torch.cat([self.history(history), self.user(users), first], dim=1))


@pytest.mark.usefixtures("_shutdown")
@pytest.mark.parametrize("model_class, user_pooled", [(_AllBags, True), (_TokenRows, False)])
def test_once_a_table_pools_the_planner_pools_the_rest_where_no_row_exchange_is_left(
        monkeypatch, model_class, user_pooled) -> None:
    """(one process: the bytes rule pools the history, stood in for) With every other table
    able to pool, pooling them too leaves no row exchange (3 collectives a step); with a
    table that cannot pool (an nn.Embedding whose rows are read one by one) the rest keep
    their rows."""
    from parallax.planning import architectures

    monkeypatch.setattr(architectures.Hybrid, "pools_bags",
                        lambda self, table, use, measured, **_: (table.name == "history.weight",
                                                                 "pooling saves bytes"))
    config = parallax.Config(partition_cache=None, sparsity_warmup_steps=1, num_partitions=2,
                             alpha_threshold=1.0)  # the others stay on the servers (one worker)
    torch.manual_seed(0)
    model = model_class().double()
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
    batch = ((torch.randint(300, (16, 8)), torch.randint(50, (16, 1))),
             torch.randint(3, (16,)))
    runner = parallax.get_runner(model, optimizer, cases.loss_fn, config=config)
    runner.step(batch)
    lines = _plan_rows(runner.plan.table())
    assert lines["history.weight"][6] == "PS: 1 partition(s) on server rank(s) 0"
    if user_pooled:
        assert lines["user.weight"][6] == "PS: 1 partition(s) on server rank(s) 0"
        assert "bags pooled with the other tables'" in lines["user.weight"][5]
    else:
        assert lines["user.weight"][6] == "PS: 2 partition(s) on server rank(s) 0"
        assert "pooled with the other" not in lines["user.weight"][5]


@pytest.mark.usefixtures("_shutdown")
@pytest.mark.parametrize("kind, message", [
    ("rows", r"which is not a sparse parameter: \["),
    ("pooled", r"which is not a sparse parameter; it takes")])
def test_a_sharding_that_names_no_table_is_refused(kind: str, message: str) -> None:
    model = Bags()
    with pytest.raises(ValueError, match=rf"Config.sharding\['out.weight'\] names "
                                         rf"'out.weight', {message}"):
        parallax.get_runner(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            lambda o, t: F.cross_entropy(o, t),
                            config=parallax.Config(sharding={"out.weight": kind}))
