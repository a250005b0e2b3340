#!/usr/bin/env bash
# The full benchmark runs of BENCHMARKS.md (not CI: tens of minutes; needs root and iproute2
# for the emulated network). Results: benchmarks/results/*.json, *.png; tables on stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ -f benchmarks/setup_bench.sh ]; then bash benchmarks/setup_bench.sh; fi
py=.venv/bin/python
$py benchmarks/compare.py --workload lm --machines 2 --nproc-per-machine 2 --rate 1gbit
$py benchmarks/compare.py --workload lm --machines 4 --nproc-per-machine 1 --rate 1gbit
$py benchmarks/compare.py --workload cnn --machines 2 --nproc-per-machine 2 --rate 1gbit \
  --systems ddp-dense hybrid allreduce ps --steps 30
(cd benchmarks && ../$py bandwidth_sweep.py --rates 100mbit 1gbit 5gbit)
$py benchmarks/alpha_crossover.py
