"""Worker of benchmarks/slim_dp.py: trains a small VGG-style CNN on Fashion-MNIST under each
dense sync in turn (same seeds, same batches), recording per step the step time and the time
spent synchronising dense parameters, the test accuracy of the trained model every few steps
(evaluation time excluded from the clock), the engine's byte counts and this machine's link
bytes. Arguments come as JSON; rank 0 writes the records to ``args["out"]``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))

from compare_worker import link_bytes  # noqa: E402
from corpora.fashion_mnist import load_fashion_mnist  # noqa: E402

import parallax  # noqa: E402
from parallax.cluster import current_worker  # noqa: E402
from parallax.launch.fast_exit import exit_now  # noqa: E402


class SmallVGG(nn.Module):
    """Two 3x3 conv blocks and three fully connected layers: ~0.5 M parameters for little
    compute (the shape of VGG-16, whose fully connected layers hold most of its weights)."""

    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(32 * 7 * 7, width), nn.ReLU(), nn.Linear(width, width),
            nn.ReLU(), nn.Linear(width, 10))

    def forward(self, images: Tensor) -> Tensor:
        return self.classifier(self.features(images))


def config_of(mode: dict[str, Any]) -> parallax.Config:
    """A mode: ``{"label", "dense_sync", "qsgd": {...} | None, "slim": {...} | None}``."""
    options: dict[str, Any] = {"dense_sync": mode["dense_sync"]}
    if mode.get("qsgd") is not None:
        options["qsgd"] = parallax.QSGD(**mode["qsgd"])
    if mode.get("slim") is not None:
        options["slim"] = parallax.SlimDP(**mode["slim"])
    return parallax.Config(partition_cache=None, sparsity_warmup_steps=0, **options)


def accuracy(state: dict[str, Tensor], images: Tensor, labels: Tensor, width: int) -> float:
    model = SmallVGG(width)
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        return float((model(images).argmax(dim=1) == labels).double().mean())


def train(mode: dict[str, Any], args: dict[str, Any], data: tuple[Tensor, Tensor],
          test: tuple[Tensor, Tensor]) -> dict[str, Any]:
    worker = current_worker()
    images, labels = data
    seed = args.get("seed", 0)
    torch.manual_seed(seed)
    model = SmallVGG(args["width"])
    optimizer = torch.optim.SGD(model.parameters(), lr=args["lr"], momentum=0.9)
    runner = parallax.get_runner(model, optimizer, nn.functional.cross_entropy,
                                 config=config_of(mode))
    generator = torch.Generator().manual_seed(1000 + worker.rank + 100_003 * seed)
    dist.barrier()
    runner.reset_stats()
    wire_before = link_bytes()
    step_s, sync_s, curve = [], [], []
    clock, evaluation_bytes = 0.0, 0
    for step in range(1, args["steps"] + 1):
        index = torch.randint(0, len(labels), (args["batch"],), generator=generator)
        before_sync = runner.dense_sync_seconds
        began = time.perf_counter()
        runner.step((images[index], labels[index]))
        elapsed = time.perf_counter() - began
        step_s.append(elapsed)
        sync_s.append(runner.dense_sync_seconds - before_sync)
        clock += elapsed
        if step % args["eval_every"] == 0 or step == args["steps"]:
            dist.barrier()
            eval_began = link_bytes()
            state = runner.state_dict()  # the servers' model under plump/slim (collective)
            if worker.rank == 0:
                curve.append({"step": step, "samples": step * args["batch"] * worker.world_size,
                              "seconds": clock,
                              "accuracy": accuracy(state, *test, args["width"])})
            dist.barrier()
            evaluation_bytes += link_bytes() - eval_began  # not training traffic
    wire = link_bytes() - wire_before - evaluation_bytes
    # every rank's times: steps are collective, so ranks differ by where their clocks start
    everyone: list[Any] = [None] * worker.world_size
    sync = runner.dense.server
    dist.all_gather_object(everyone, {"step_s": step_s, "sync_s": sync_s, "wire": wire,
                                      "stats": runner.stats(),
                                      "choosing_s": sync.choosing_seconds if sync else 0.0})
    return {"label": mode["label"], "mode": mode, "curve": curve, "ranks": everyone,
            "params": sum(p.numel() for p in model.parameters())}


def main() -> None:
    args = json.loads(sys.argv[1])
    worker = current_worker()
    torch.set_num_threads(1)
    images, labels = load_fashion_mnist("train")
    test_images, test_labels = load_fashion_mnist("test")
    test = (test_images[:args["eval_size"]], test_labels[:args["eval_size"]])
    modes = args["modes"]
    shift = args.get("order_shift", 0) % len(modes)
    records = []
    for mode in modes[shift:] + modes[:shift]:
        if worker.rank == 0:
            print(f"slim_dp: {mode['label']} ({args['steps']} steps)", file=sys.stderr,
                  flush=True)
        records.append(train(mode, args, (images, labels), test))
    if worker.rank == 0:
        Path(args["out"]).write_text(json.dumps(records))
    parallax.shutdown()


if __name__ == "__main__":
    main()
    exit_now()  # parallax.launch.fast_exit: no second of teardown per worker
