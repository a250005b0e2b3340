"""Your own training loop, distributed: the LSTM language model of train_lm.py written as an
ordinary single-device PyTorch loop (zero_grad, forward, loss, backward, clip, step, and a
next-word accuracy computed from the outputs), plus three parallax lines, marked ``# parallax``.

    parallax run --machines 2 --nproc-per-machine 2 examples/own_loop_lm.py

Without ``parallax run`` (plain ``python examples/own_loop_lm.py``) it trains in this process
alone. ``--corpus PATH`` trains on any plain-text file instead of the KJV Bible.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))

from corpora.kjv import fetch_kjv  # noqa: E402
from corpora.text import load_text_corpus  # noqa: E402
from lstm_lm import LanguageModel  # noqa: E402

import parallax  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, help="plain-text corpus (default: KJV Bible)")
    parser.add_argument("--vocab", type=int, default=10_000)
    parser.add_argument("--max-steps", type=int, default=100)
    args = parser.parse_args()
    train, _, vocab = load_text_corpus(args.corpus or fetch_kjv(), args.vocab, 35)

    torch.manual_seed(0)  # the same initial model in every run (and parallax verify's)
    model = LanguageModel(len(vocab), emb_dim=64, hidden=128)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.2)
    model, optimizer = parallax.distribute(model, optimizer)  # parallax
    loader = parallax.shard(DataLoader(train, batch_size=16, shuffle=True))  # parallax

    lead = dist.get_rank() == 0  # distribute joined the process group, as DDP programs do
    for step, (tokens, targets) in enumerate(loader, 1):
        optimizer.zero_grad()
        logits = model(tokens)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        parallax.clip_grad_norm_(model.parameters(), 10.0)  # parallax (was torch.nn.utils's)
        optimizer.step()
        accuracy = (logits.argmax(-1) == targets).double().mean()  # this worker's slice
        if lead and (step % 20 == 0 or step == args.max_steps):
            print(f"step {step}: loss {float(loss):.3f}, next-word accuracy "
                  f"{float(accuracy):.3f} (rank 0's slice)", flush=True)
        if step == args.max_steps:
            break
    state = model.state_dict()  # the plain single-device state dict, on every rank
    if lead:
        LanguageModel(len(vocab), emb_dim=64, hidden=128).load_state_dict(state)
        print(f"trained {step} steps; exported a plain state_dict of {len(state)} tensors",
              flush=True)
    parallax.shutdown()


if __name__ == "__main__":
    main()
