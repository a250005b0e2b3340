#!/usr/bin/env bash
# Style check and the whole test suite (equivalence matrix, error paths, launcher, data).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests examples
exec .venv/bin/pytest -q "$@"
