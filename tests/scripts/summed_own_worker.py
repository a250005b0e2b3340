"""Worker of test_summed_own.py: the hybrid moves both tables of `Mixed` to AllReduce after
two warm-up steps (``alpha_threshold=0``), where each becomes the program's own parameter
with its gradient summed over the workers (`parallax.engine.tables.own_summed`). The own
loop accumulates two half-batches per step (``zero_grad(set_to_none=False)`` every other
step) and saves the embedding's ``.grad`` as the program reads it after the backward
passes, once moved; then rank 1 looks up an id outside the table, every rank records the error
it caught (in a forward, and in the program's own call of the layer), and one more step
trains. One step before is profiled: its collectives.

Usage: parallax run ... summed_own_worker.py OUT_DIR"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from equivalence_cases import Case, Mixed, global_batches, loss_fn, worker_slice  # noqa: E402

import parallax  # noqa: E402
from parallax.cluster import current_worker  # noqa: E402
from parallax.launch.fast_exit import exit_now  # noqa: E402

STEPS = 6
WARMUP = 2


def main() -> None:
    out = Path(sys.argv[1])
    worker = current_worker()
    torch.manual_seed(0)
    model = Mixed().double()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    config = parallax.Config(collective_timeout_s=60, partition_cache=None, alpha_threshold=0.0,
                             sparsity_warmup_steps=WARMUP)
    model, optimizer = parallax.distribute(model, optimizer, config=config)
    grads, kinds = [], set()
    batches = global_batches(Case("mixed", "adam", steps=STEPS + 1))
    for step, batch in enumerate(batches[:STEPS], 1):
        x, y = worker_slice(batch, worker.rank, worker.world_size)
        optimizer.zero_grad(set_to_none=step % 2 == 1)
        half = x.shape[0] // 2
        for part in (slice(0, half), slice(half, None)):
            (loss_fn(model(x[part]), y[part]) / 2).backward()
        if step > WARMUP:  # (on the servers before: their rows, no .grad to read)
            grads.append(model.embedding.weight.grad.detach().clone())
        optimizer.step()
        kinds |= {type(t).__name__ for t in model.runner.tables.values()}
    x, y = worker_slice(batches[STEPS], worker.rank, worker.world_size)
    collectives = counted_step(model, optimizer, x, y)
    bad = x.clone()
    if worker.rank == 1:
        bad[0, 0] = 10**6
    errors = []
    # the forward's look-ahead agrees its ids; the program's own call of the layer, which
    # no look-ahead sees, its own
    for call in (lambda: model(bad), lambda: model.embedding(bad)):
        try:
            call()
            errors.append(None)
        except parallax.SparseIdError as caught:
            errors.append(str(caught))
    optimizer.zero_grad()
    loss_fn(model(x), y).backward()  # the run goes on, every rank in step
    optimizer.step()
    state = model.state_dict()
    torch.save({"grads": grads, "kinds": sorted(kinds), "errors": errors, "state": state,
                "collectives": collectives}, out / f"rank{worker.rank}.pt")
    parallax.shutdown()


def counted_step(model, optimizer, x, y) -> dict[str, list[str]]:
    """One more step of the moved tables, its collectives by phase (the profiler's names)."""
    counted = {}
    for phase, run in (("forward", lambda: model(x)), ("backward and step", None)):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            if run is not None:
                output = run()
            else:
                optimizer.zero_grad()
                loss_fn(output, y).backward()
                optimizer.step()
        counted[phase] = [e.name for e in prof.events() if e.name.startswith("c10d::")]
    return counted


if __name__ == "__main__":
    main()
    exit_now()
