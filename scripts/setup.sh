#!/usr/bin/env bash
# Creates .venv with the pinned CPU build of torch and parallax (editable) plus dev tools.
# Idempotent: a second run only re-installs when pyproject.toml or constraints.txt changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
# The emulated cluster (network namespaces, tc) needs iproute2; its tests skip without it.
if ! command -v tc >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get install -y -q iproute2 >/dev/null 2>&1 || echo "setup: could not install iproute2" >&2
fi
stamp="$VENV/.parallax-installed"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt constraints.txt ]; then
  exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
# constraints.txt pins torch==2.13.0, which has a local CPU build; an unpinned torch pulls GBs
# of CUDA packages. Torch goes first so nothing else can choose it.
"$VENV/bin/pip" install -q -c constraints.txt torch
"$VENV/bin/pip" install -q -c constraints.txt -e '.[dev]'
touch "$stamp"
