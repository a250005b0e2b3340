#!/usr/bin/env bash
# The full benchmark runs of BENCHMARKS.md (not CI: an hour or more; needs root and iproute2
# for the emulated network). Results: benchmarks/results/*.json, *.md, *.png; tables on stdout.
# Every experiment runs even when an earlier one failed; the exit status says whether any did.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
if [ -f benchmarks/setup_bench.sh ]; then bash benchmarks/setup_bench.sh || exit 1; fi
py=.venv/bin/python
failed=()
run() {
  echo "== $*"
  "$@" || failed+=("$*")
}
# Systems side by side (one table each)
run $py benchmarks/compare.py --workload lm --machines 2 --nproc-per-machine 2 --rate 1gbit
run $py benchmarks/compare.py --workload lm --machines 4 --nproc-per-machine 1 --rate 1gbit \
  --systems hybrid optps ps allreduce ddp-sparse ddp-dense torchrec-rw torchrec-tw --isolate
run $py benchmarks/compare.py --workload lm --machines 2 --nproc-per-machine 2 --rate 1gbit \
  --workload-options '{"corpus": "kjv"}' --systems hybrid ddp-sparse ddp-dense torchrec-rw \
  --isolate --out benchmarks/results/compare-lm-kjv-2x2-1gbit.json
run $py benchmarks/compare.py --workload recsys --machines 2 --nproc-per-machine 2 --rate 1gbit \
  --hash-multiplier 1000 --systems hybrid-lazy hybrid-sparse hybrid ddp-sparse torchrec-rw \
  torchrec-tw --steps 10 --isolate
run $py benchmarks/compare.py --workload cnn --machines 2 --nproc-per-machine 2 --rate 1gbit \
  --systems ddp-dense hybrid allreduce ps --steps 30
# Issue 4's experiments; --isolate: one launch per system, so peak memory is per system
run $py benchmarks/table1.py --machines 2 --nproc-per-machine 2 --rate 1gbit --isolate
run $py benchmarks/table4.py --machines 2 --nproc-per-machine 2 --rate 1gbit --isolate
run $py benchmarks/scaling.py --machines 1 2 4 8 --nproc-per-machine 1 --rate 1gbit --isolate
run $py benchmarks/sparsity_sweep.py --machines 2 --nproc-per-machine 2 --rate 1gbit --isolate
run $py benchmarks/bandwidth_sweep.py --rates 100mbit 1gbit 5gbit --isolate
run $py benchmarks/alpha_crossover.py
# Issue 5: partition counts, brute force against the in-process search (Tables 2 and 5)
run $py benchmarks/partitions.py --machines 2 --nproc-per-machine 2 --rate 1gbit
run $py benchmarks/partitions.py --machines 4 --nproc-per-machine 1 --rate 1gbit
if [ ${#failed[@]} -gt 0 ]; then
  printf 'bench.sh: failed: %s\n' "${failed[@]}" >&2
  exit 1
fi
