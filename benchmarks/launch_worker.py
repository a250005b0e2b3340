"""Worker of launch_overhead.py: prints wall-clock marks of its start, imports, runner, one step
and shutdown as one ``[launch] {json}`` line, then ends as a user's program ends (no fast exit:
the teardown is part of what is measured)."""

import time

marks = {"start": time.time()}

import json  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

import parallax  # noqa: E402

marks["imported"] = time.time()
torch.manual_seed(0)
model = nn.Sequential(nn.EmbeddingBag(100, 8), nn.Linear(8, 1))
runner = parallax.get_runner(model, torch.optim.SGD(model.parameters(), lr=0.1),
                             lambda out, y: nn.functional.mse_loss(out.squeeze(1), y),
                             config=parallax.Config(partition_cache=None))
marks["runner"] = time.time()
runner.step((torch.randint(100, (4, 3)), torch.rand(4)))
marks["stepped"] = time.time()
parallax.shutdown()
marks["shutdown"] = time.time()
print("[launch] " + json.dumps(marks), flush=True)
