#!/usr/bin/env bash
# Build the documentation site and photograph every page of it with headless
# Chromium (Debian's chromium; installed here when missing and running as root), then check
# that each picture shows a rendered page (not blank, not one colour).
#   bash scripts/docs_screenshots.sh [OUT_DIR]       (default: site-screenshots/)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-site-screenshots}
bash scripts/setup.sh
browser=$(command -v chromium || command -v chromium-browser || true)
if [ -z "$browser" ] && [ "$(id -u)" = 0 ]; then
  apt-get install -y -q chromium >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }
  browser=$(command -v chromium)
fi
[ -n "$browser" ] || { echo "docs_screenshots: no chromium (apt-get install chromium)" >&2; exit 1; }
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
.venv/bin/mkdocs build --strict --site-dir "$site" >/dev/null
mkdir -p "$out"
# every page the site built (its nav: home, guides, concepts, tutorials, reference, ...)
pages=$(cd "$site" && find . -name index.html -not -path "./search/*" | sed 's#^\./##' | sort)
for page in $pages; do
  name=$(dirname "$page" | tr / -)
  [ "$name" = . ] && name=index
  "$browser" --headless=new --no-sandbox --disable-gpu --hide-scrollbars \
    --window-size=1280,1600 --screenshot="$out/$name.png" "file://$site/$page" >/dev/null 2>&1
done
.venv/bin/python - "$out" <<'PY'
import sys
from pathlib import Path

import matplotlib.image as image
import numpy as np

for png in sorted(Path(sys.argv[1]).glob("*.png")):
    pixels = np.asarray(image.imread(png))[..., :3]
    colours = len(np.unique((pixels * 255).astype(np.uint8).reshape(-1, 3), axis=0))
    dark = float((pixels.mean(axis=2) < 0.5).mean())  # text, header, code: dark pixels
    ok = pixels.std() > 0.05 and colours > 50 and 0.005 < dark < 0.9
    print(f"{png}: {pixels.shape[1]}x{pixels.shape[0]}, {colours} colours, "
          f"{dark:.1%} dark: {'rendered' if ok else 'NOT RENDERED'}")
    if not ok:
        sys.exit(1)
PY
