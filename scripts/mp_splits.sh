#!/usr/bin/env bash
# Seed 004's three parallelisms on a fast link and on 1 Gbit/s, with Megatron pairs and with
# the report's gather-every-layer split, in one sitting (issue 38 item 9): four runs of
# benchmarks/model_parallel.py into $PARALLAX_BENCH_OUT/mp-splits/ (bench.sh files it as a record directory).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
out=${PARALLAX_BENCH_OUT:-benchmarks/out}/mp-splits
for rate in none 1gbit; do
  for split in pairs every-layer; do
    echo "== mp-splits: rate $rate, split $split"
    "$py" benchmarks/model_parallel.py --data airfoil --widths 128 512 1024 --processes 1 2 4 \
      --rate "$rate" --model-split "$split" --steps 40 --no-plot --out-dir "$out"
  done
done
