#!/usr/bin/env bash
# Main job: LSTM language model on the KJV Bible, local cluster of 2 machines x 2 workers.
# Extra arguments go to examples/train_lm.py (e.g. --max-steps 0 for a whole epoch).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The corpus is fetched here, once, before any worker starts (workers of an emulated cluster
# cannot download); --corpus FILE trains on a file of yours instead.
case " $* " in
  *" --corpus "*|*" --corpus="*) ;;
  *) .venv/bin/python examples/fetch_corpora.py kjv ;;
esac
exec .venv/bin/parallax run --machines 2 --nproc-per-machine 2 examples/train_lm.py "$@"
