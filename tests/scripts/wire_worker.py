"""Worker of the emulated-network test: bytes on the wire (the namespace's eth0 counters)
against the bytes the engine accounts, for the training steps alone.

Usage: parallax run --machines 2 --nproc-per-machine 2 --emulate-network 1gbit \
           wire_worker.py OUT.json"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from traffic_worker import Model  # noqa: E402

import parallax  # noqa: E402
from parallax.launch.fast_exit import exit_now  # noqa: E402
from parallax.planning import link  # noqa: E402
from parallax.step.hooks import DENSE_SYNC_ACCOUNTS  # noqa: E402

STEPS = 8
ROWS, DIM, USED = 20_000, 256, 400  # payloads large enough that packet headers are noise


def batch(step: int, worker: parallax.cluster.WorkerInfo) -> tuple[torch.Tensor, torch.Tensor]:
    start = (step * 997 + worker.machine * 5000 + worker.local_rank * USED // 2) % ROWS
    ids = (start + torch.arange(USED)) % ROWS
    return ids.repeat(4, 1), torch.randint(0, 64, (4,))


def link_bytes() -> float:
    stats = Path("/sys/class/net/eth0/statistics")
    return float(int((stats / "tx_bytes").read_text()) + int((stats / "rx_bytes").read_text()))


#: run name -> Config options: two architectures, and the dense syncs that count their bytes
#: per message rather than per parameter (`inter_machine_bytes` must add those too)
RUNS = {"optps": dict(architecture="optps"), "ps": dict(architecture="ps"),
        "qsgd": dict(dense_sync="qsgd"), "plump": dict(dense_sync="plump"),
        "slim": dict(dense_sync="slim", slim=parallax.SlimDP(sync_every=2))}


def main() -> None:
    results = {}
    for name, options in RUNS.items():
        torch.manual_seed(0)
        model = Model(rows=ROWS, dim=DIM)
        runner = parallax.get_runner(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                     nn.functional.cross_entropy,
                                     config=parallax.Config(sparsity_warmup_steps=0,
                                                            partition_cache=None, **options))
        runner.step(batch(0, runner.worker))  # connections opened, buffers allocated
        runner.reset_stats()
        dist.barrier()
        before = link_bytes()
        for step in range(1, STEPS + 1):
            runner.step(batch(step, runner.worker))
        dist.barrier()
        wire = torch.tensor([link_bytes() - before if runner.worker.is_server else 0.0],
                            dtype=torch.float64)
        dist.all_reduce(wire)  # one eth0 per machine: read it once per machine
        per_account = runner.inter_machine_bytes()
        accounted = sum(per_account.values())
        dense_sync = sum(per_account[name] for name in DENSE_SYNC_ACCOUNTS)
        machines = len(runner.worker.server_ranks)
        results[name] = {"wire": float(wire) / machines / STEPS, "accounted": accounted,
                         "dense_sync": dense_sync}
    probed = link.measure(runner.worker, dist.group.WORLD)  # the plan's link probe
    assert probed is not None
    results["link"] = {"bytes_per_s": probed.bytes_per_s, "latency_s": probed.latency_s}
    if runner.worker.rank == 0:
        Path(sys.argv[1]).write_text(json.dumps(results))
    parallax.shutdown()


if __name__ == "__main__":
    main()
    exit_now()
