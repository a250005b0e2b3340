"""Main job: a word-level LSTM language model on the King James Bible, trained with parallax.

The single-device program, with the three parallax lines marked. Start it on a local cluster of
2 machines x 2 workers with

    parallax run --machines 2 --nproc-per-machine 2 examples/train_lm.py

or let it launch itself from a resource file: ``python examples/train_lm.py --resources
examples/resources.txt``. ``--corpus PATH`` trains on any plain-text file instead.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

try:
    from tqdm import tqdm
except ImportError:  # not a dependency of the library
    sys.exit("examples/train_lm.py shows its progress with tqdm: pip install tqdm "
             "(or pip install '.[examples]')")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from corpora.kjv import fetch_kjv  # noqa: E402
from corpora.text import load_text_corpus  # noqa: E402
from lstm_lm import LanguageModel, lm_loss  # noqa: E402

import parallax  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, help="plain-text corpus (default: KJV Bible)")
    parser.add_argument("--resources", help="resource file; python train_lm.py then launches "
                        "the workers itself")
    parser.add_argument("--vocab", type=int, default=10_000, help="vocabulary size")
    parser.add_argument("--seq-len", type=int, default=35)
    parser.add_argument("--batch-size", type=int, default=16, help="per worker")
    parser.add_argument("--emb-dim", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.2, help="Adagrad learning rate")
    parser.add_argument("--clip", type=float, default=10.0, help="global gradient-norm clip")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=300, help="stop an epoch early "
                        "after this many steps (0: whole epoch)")
    parser.add_argument("--max-valid-batches", type=int, default=20, help="per worker")
    parser.add_argument("--sync", default="sync", choices=["sync", "async", "async-sparse"],
                        help="Config.sync: 'async' puts every parameter on asynchronous "
                        "servers (architecture ps), 'async-sparse' only the embeddings")
    parser.add_argument("--max-staleness", type=int, default=None,
                        help="Config.max_staleness under --sync async/async-sparse")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    corpus = args.corpus or fetch_kjv()
    train, valid, vocab = load_text_corpus(corpus, args.vocab, args.seq_len)
    torch.manual_seed(0)  # the same initial model in every run (and parallax verify's)
    model = LanguageModel(len(vocab), emb_dim=args.emb_dim, hidden=args.hidden)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=args.lr)

    train_loader = parallax.shard(DataLoader(train, batch_size=args.batch_size, shuffle=True))
    valid_loader = parallax.shard(DataLoader(valid, batch_size=args.batch_size))
    config = parallax.Config(
        # async-sparse has no global norm to clip by (dense aggregated, sparse per worker)
        clip_grad_norm=None if args.sync == "async-sparse" else args.clip, sync=args.sync,
        architecture="ps" if args.sync == "async" else "hybrid",
        max_staleness=args.max_staleness)
    runner = parallax.get_runner(model, optimizer, lm_loss, resources=args.resources,
                                 config=config)

    lead = runner.worker.rank == 0
    world = runner.worker.world_size
    if lead:
        print(f"corpus {corpus}: {len(train):,} training windows of {args.seq_len} words, "
              f"vocabulary {len(vocab):,}")
        print(runner.plan.table(), flush=True)
    for epoch in range(args.epochs):
        steps = len(train_loader) if not args.max_steps else min(args.max_steps,
                                                                   len(train_loader))
        bar = tqdm(total=steps, desc=f"epoch {epoch}", disable=not lead, unit="step",
                   file=sys.stdout)
        start, words = time.perf_counter(), 0
        began = runner.workers_steps()
        for step, batch in enumerate(train_loader):
            if step == steps:
                break
            runner.step(batch)
            # every worker's batch has the same size; asynchronous workers are not in the same
            # step: count what all of them finished
            done = runner.workers_steps() - began
            words = done * batch[0].numel()  # the epoch's, for its summary line
            bar.update()
            if step % 10 == 9 or step + 1 == steps:  # the last ten steps' numbers
                recent = runner.headline()
                bar.set_postfix(loss=f"{recent['loss']:.3f}",
                                words_per_s=f"{recent['targets_per_s']:,.0f}",
                                MB_per_step=f"{recent['bytes_per_step'] / 1e6:.2f}")
        bar.close()
        elapsed = time.perf_counter() - start
        valid_batches = (b for i, b in enumerate(valid_loader) if i < args.max_valid_batches)
        valid_loss = runner.evaluate(valid_batches)
        if lead:
            print(f"epoch {epoch}: {steps} steps, {words:,} words in {elapsed:.1f} s = "
                  f"{words / elapsed:,.0f} words/s on {world} workers; validation perplexity "
                  f"{math.exp(valid_loss):.1f}", flush=True)
    measured = runner.inter_machine_bytes()
    if lead:
        print(runner.plan.table())
        predicted = runner.plan.predicted_total(runner.config.architecture)
        print(f"measured inter-machine bytes per machine and step: {sum(measured.values()):,.0f}"
              f" (predicted {predicted:,.0f})" if predicted is not None else "", flush=True)
    state = runner.state_dict()
    if lead:
        check = LanguageModel(len(vocab), emb_dim=args.emb_dim, hidden=args.hidden)
        check.load_state_dict(state)
        print(f"exported a plain state_dict of {len(state)} tensors, loadable into "
              f"LanguageModel", flush=True)


if __name__ == "__main__":
    main()
