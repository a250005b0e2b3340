#!/usr/bin/env bash
# The GPU path in one command, on a machine with CUDA (and ideally 16 CPU cores): CUDA
# equivalence against the CPU reference, the LM on one GPU against plain PyTorch and DDP, and
# the checks that need more cores than the 2-core dev host (partition search, local
# aggregation). Writes gpu-check/gpu-check.json and gpu-check.md (or --out DIR).
# Uses PYTHON when set, else the project's .venv python when it exists (scripts/setup.sh makes
# it), else python3; and this checkout's src/.
# Exit status: 0 all checks passed, 1 one failed or differed, 2 no CUDA device here.
#   bash scripts/gpu_check.sh [--out DIR] [--only CHECK ...] [--plan]
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" benchmarks/gpu_check.py "$@"
