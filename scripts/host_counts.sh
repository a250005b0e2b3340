#!/usr/bin/env bash
# The host work per step that tests/benchmarks/test_host_work.py guards, measured at its
# settings (the plan's timed choices pinned: one partition per table, no leader hop, no early
# push) for both doors at 1 worker and at 1 machine x 2 workers: four outputs in the directory
# given (bench.sh: the experiment's scratch directory), each filed as its own record. At 2
# workers TorchRec's row-wise LM runs beside DDP on the same batches (host_work.py --torchrec).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
out=${1:-benchmarks/out/host-counts}
mkdir -p "$out"
for workers in 1 2; do
  peers=()
  if [ "$workers" -gt 1 ]; then peers=(--torchrec); fi
  for door in distribute runner; do
    "$py" benchmarks/host_work.py --workers "$workers" --door "$door" --partitions 1 \
      --local-aggregation off --no-overlap-push --rounds 7 "${peers[@]}" \
      --out "$out/host-counts-${workers}w-${door}.json"
  done
done
