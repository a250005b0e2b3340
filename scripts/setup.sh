#!/usr/bin/env bash
# Creates .venv with the pinned CPU build of torch and parallax (editable) plus dev tools.
# Idempotent: a second run only re-installs when pyproject.toml or constraints.txt changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
# The emulated cluster (network namespaces, tc) needs iproute2; its tests skip without it.
# The ssh launch's test runs Debian's sshd inside two of those namespaces (openssh-server).
need=()
command -v tc >/dev/null 2>&1 || need+=(iproute2)
{ command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ]; } || need+=(openssh-server)
command -v ssh >/dev/null 2>&1 || need+=(openssh-client)
if [ ${#need[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get install -y -q "${need[@]}" >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q "${need[@]}" >/dev/null 2>&1; } \
    || echo "setup: could not install ${need[*]} (their tests will be skipped)" >&2
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
