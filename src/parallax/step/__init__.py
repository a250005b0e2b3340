"""The parts a `parallax.Runner` coordinates, each behind a small contract and chosen once at
construction (the runner never asks which kind it holds):

* `sync_modes` — `Config.sync`: synchronous or asynchronous servers (``prefetch``, ``push``,
  ``update``);
* `parallax.engine.dense_sync.strategy` — `Config.dense_sync`: comm-hook or server kinds;
* `round` — the step round (begin, gradients ready, optimizers done, end → `hooks.StepDone`);
* `gradients` — the step's gradients wherever they live (zero, clip, check);
* `nonfinite` — `Config.nonfinite`, for every sync mode;
* `forward` — the forward with its rows pulled ahead; `loop_order` — the own loop's order check;
* step hooks, after every step: `plan_keeper` (warm-up, partition search, ``parallax plan``),
  `checkpoints` (save, load, resume, schedule), `hooks.Reporting` (TensorBoard, headline,
  bytes);
* `parallax.checkpoint.single_device` — the single-device view (state dicts out and in, export).

Adding a sync mode or a dense-sync kind is one class and a registry entry (`docs/extending.md`).
"""

from parallax.lazy import submodule_attributes

__getattr__ = submodule_attributes(__name__)
