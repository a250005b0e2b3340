"""Worker of the asynchronous early-finish test: under Config(sync="async", max_staleness=2) on
2 machines x 2 workers, each rank trains its own number of steps and ends (servers ranks 0 and 2
among them) while the others go on: a finished worker must not hold anyone back, a finished
server must keep serving until every worker is done, and no push may be lost. After shutdown
each server writes how many updates it applied (one per push: every worker pushes to every
server each step) to OUT_DIR/updates-RANK.

Usage: parallax run --machines 2 --nproc-per-machine 2 async_uneven_worker.py OUT_DIR"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from models import EmbeddingRegressor  # noqa: E402
from torch import nn  # noqa: E402

import parallax  # noqa: E402
from parallax.launch.fast_exit import exit_now  # noqa: E402

STEPS = {0: 4, 1: 2, 2: 12, 3: 20}  # per rank


def main() -> None:
    out = Path(sys.argv[1])
    torch.manual_seed(0)
    model = EmbeddingRegressor(rows=100)
    config = parallax.Config(sync="async", architecture="ps", max_staleness=2,
                             partition_cache=None, collective_timeout_s=60)
    runner = parallax.get_runner(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 nn.functional.mse_loss, config=config)
    rank = runner.worker.rank
    generator = torch.Generator().manual_seed(rank)
    for _ in range(STEPS[rank]):
        runner.step((torch.randint(100, (8, 3), generator=generator),
                     torch.rand(8, generator=generator)))
    state = runner.sync_mode.training.state
    parallax.shutdown()  # a server serves here until every worker is done
    if state is not None:
        (out / f"updates-{rank}").write_text(str(state.updates))


if __name__ == "__main__":
    main()
    exit_now()
