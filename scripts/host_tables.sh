#!/usr/bin/env bash
# What each table costs the host: the benchmark LM with 0, 2 and 6 input tables beside its two,
# all alike (host_work.py --extra-tables), at 1 machine x 2 workers for both doors, at the
# settings of host_counts.sh (one partition per table, no leader hop, no early push); each
# output filed as its own record (bash scripts/bench.sh host-tables).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
out=${1:-benchmarks/out/host-tables}
mkdir -p "$out"
for extra in 0 2 6; do
  for door in distribute runner; do
    "$py" benchmarks/host_work.py --workers 2 --door "$door" --partitions 1 \
      --local-aggregation off --no-overlap-push --rounds 3 --extra-tables "$extra" \
      --out "$out/host-tables-2w-${door}-${extra}extra.json"
  done
done
