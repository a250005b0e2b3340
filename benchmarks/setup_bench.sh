#!/usr/bin/env bash
# Benchmark-only extras in .venv (never dependencies of the library): TorchRec as a peer system
# and pyarrow for the MovieLens-100k parquet files (benchmarks/recsys.py).
# TorchRec is pinned to the CPU fbgemm build matching torch 2.13.0 and installed --no-deps so
# pip cannot replace the pinned torch with a CUDA build; its runtime deps are listed explicitly.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || bash scripts/setup.sh
PIP=("$VENV/bin/pip" install -q)
"${PIP[@]}" --no-deps fbgemm-gpu-cpu==1.8.0 torchrec==1.8.0
"${PIP[@]}" tensordict torchmetrics==1.0.3 pyre-extensions matplotlib pyarrow
"$VENV/bin/python" - <<'PY'
import fbgemm_gpu, pyarrow, torch, torchrec  # noqa: F401
print(f"setup_bench: torch {torch.__version__}, torchrec {torchrec.__version__}, "
      f"pyarrow {pyarrow.__version__}")
PY
