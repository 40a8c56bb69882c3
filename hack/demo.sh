#!/usr/bin/env bash
# The README's main job: provision an offload pool on THIS machine (no cluster), show the
# pre-fault progress and a summary, then release it. Needs root (mounts, huge pages).
#   sudo bash hack/demo.sh [--capacity 4Gi] [--medium MemoryTHP] [--keep] [--root DIR]
# Default medium: HugePages-2Mi when the kernel can reserve the pages, else MemoryTHP.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ $EUID -ne 0 ]]; then
  echo "hack/demo.sh needs root: it mounts hugetlbfs/tmpfs and reserves huge pages" >&2
  exit 1
fi
if [[ ! -x .venv/bin/offloadpool ]]; then
  python3 -m venv .venv
  .venv/bin/pip install --quiet -e '.[agent]'
fi
exec .venv/bin/offloadpool demo "$@"
