#!/usr/bin/env bash
# Style check, type check and the whole test suite (equivalence matrix, error paths, launcher, data).
#   bash scripts/test.sh            everything (14-18 min on 2 cores, two pytest processes)
#   bash scripts/test.sh --fast     unit tests + one equivalence case per architecture (~1 min)
#   bash scripts/test.sh ARGS       any pytest arguments (e.g. tests/integration -k uneven)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests examples benchmarks
.venv/bin/mypy  # strict on src/ (pyproject.toml [tool.mypy])
if [ "${1:-}" = "--fast" ]; then
  shift
  exec .venv/bin/pytest -q -m "(unit or fast) and not network" "$@"
fi
# Two pytest processes (pytest-xdist), each taking whole files: much of the suite waits
# (launches, rendezvous, timeouts a test provokes), and a file's module-scoped setups (the
# equivalence matrix's groups) run once. Fresh-clone CI on one host: 17:28 with xdist's
# default order (files with most tests first), 18:48 in collection order (--no-loadscope-
# reorder). PYTEST_WORKERS=0 runs it in one process.
exec .venv/bin/pytest -q -n "${PYTEST_WORKERS:-2}" --dist loadfile "$@"
