#!/usr/bin/env bash
# What a table the plan replicates costs the host at several workers: the benchmark LM at
# 1 machine x 2 workers with Config(alpha_threshold=0) (host_work.py --replicate: the hybrid
# moves both tables to AllReduce after the warm-up), both doors, at the settings of
# host_counts.sh; each output filed as its own record (bash scripts/bench.sh host-replicated).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
out=${1:-benchmarks/out/host-replicated}
mkdir -p "$out"
for door in distribute runner; do
  "$py" benchmarks/host_work.py --workers 2 --door "$door" --partitions 1 \
    --local-aggregation off --no-overlap-push --rounds 5 --replicate \
    --out "$out/host-replicated-2w-${door}.json"
done
