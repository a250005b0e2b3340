#!/usr/bin/env bash
# What CI sees: clones the committed main branch into a temporary folder and runs .ci/run there,
# with a new virtual environment, an empty pip cache and an empty corpus cache. Run it before
# you stop; a green run in your own checkout (warm .venv, warm caches) proves nothing.
#   bash scripts/ci_fresh.sh [BRANCH]      (default: main)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
branch=${1:-main}
work=$(mktemp -d -t parallax-ci-fresh.XXXXXX)
trap 'rm -rf "$work"' EXIT
git clone -q --branch "$branch" "file://$repo" "$work/clone"
echo "ci_fresh: $(git -C "$work/clone" log --oneline -1) in $work/clone"
start=$(date +%s)
status=0
PIP_CACHE_DIR="$work/pip-cache" bash "$work/clone/.ci/run" || status=$?
echo "ci_fresh: .ci/run exited $status after $(( $(date +%s) - start )) s"
exit $status
