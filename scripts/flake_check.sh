#!/usr/bin/env bash
# Runs the tests that start groups of processes N times in a row (default 10) and stops at the
# first failure: the suite must not flake (gloo aborting at exit, a port taken, a slow start).
# The equivalence matrix itself runs once per CI; here its other start modes run every time.
#   bash scripts/flake_check.sh [N]
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-10}
tests=(tests/integration/test_errors.py tests/integration/test_launch.py
       tests/integration/test_checkpoint.py tests/integration/test_restarts_cli.py
       tests/integration/test_traffic.py tests/integration/test_partition_tuning.py
       tests/integration/test_netem.py
       "tests/equivalence/test_equivalence.py::test_other_start_modes_train_the_same")
for i in $(seq 1 "$runs"); do
  start=$(date +%s)
  .venv/bin/python -m pytest -q -p no:cacheprovider "${tests[@]}" > "/tmp/flake-$i.log" 2>&1 || {
    echo "flake_check: run $i of $runs FAILED (log: /tmp/flake-$i.log)"; tail -30 "/tmp/flake-$i.log"
    exit 1; }
  echo "flake_check: run $i of $runs passed ($(tail -1 "/tmp/flake-$i.log")) in $(( $(date +%s) - start )) s"
done
