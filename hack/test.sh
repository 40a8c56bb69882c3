#!/usr/bin/env bash
# The one test command:  bash hack/test.sh [pytest args...]
#
# On a fresh Debian/Ubuntu machine (as root, with only package registries reachable) it
#   0. reserves the huge pages the suite needs (hack/hugepages.py) before anything else, while
#      memory is still unfragmented, and keeps them for later runs (give them back with
#      `python3 hack/hugepages.py release`); it stops at once, with one message, if it cannot,
#   1. installs missing system packages (python3-venv, openssl, ...) with apt-get,
#   2. finds Go >= 1.26, or has an older go command switch to the pinned release
#      (GOTOOLCHAIN, fetched through the Go module proxy),
#   3. creates/updates .venv with `pip install -e '.[test]'`, and installs the pinned vLLM the
#      vllm tests drive into a venv cached outside the clone (hack/vllm_env.py, docs/vllm.md),
#   4. builds the real control plane (etcd, kube-apiserver, kube-controller-manager, kubectl,
#      helm) into ${OFFLOADPOOL_CACHE:-/var/cache/offloadpool} — once; later runs reuse it,
#   5. runs the whole suite: .venv/bin/python -m pytest "$@".
# It exits non-zero if any test fails, if no test ran, or if any test was skipped or xfailed
# (the project's rule: a test that cannot run must fail, never skip).
# Wall time of every phase is printed at the end. See docs/testing.md.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

export OFFLOADPOOL_CACHE="${OFFLOADPOOL_CACHE:-/var/cache/offloadpool}"
# The Go used when none (or too old a one) is installed. Kubernetes v1.37.2 needs >= 1.26.0.
GO_BOOTSTRAP_VERSION="1.26.8"
GO_MIN_MINOR=26

PHASES=()
START_ALL=$(date +%s)
phase_start() { PHASE_NAME="$1"; PHASE_T0=$(date +%s); echo "==> $1" >&2; }
phase_end() {
  local dt=$(( $(date +%s) - PHASE_T0 ))
  PHASES+=("$(printf '%-28s %5ss' "$PHASE_NAME" "$dt")")
  echo "==> $PHASE_NAME: ${dt}s" >&2
}
REPORT_DIR=""
summary() {
  local rc=$?
  [ -z "$REPORT_DIR" ] || rm -rf "$REPORT_DIR"
  echo >&2
  echo "==> wall time per phase" >&2
  for p in "${PHASES[@]}"; do echo "    $p" >&2; done
  echo "    $(printf '%-28s %5ss' total "$(( $(date +%s) - START_ALL ))")" >&2
  exit "$rc"
}
trap summary EXIT

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"
  elif command -v sudo >/dev/null; then sudo "$@"
  else echo "need root to run: $*" >&2; return 1
  fi
}

# ---- 0. huge pages -------------------------------------------------------------------------
# First, before any build or install fragments memory: a 1 GiB page needs a contiguous GiB.
phase_start "huge page reservation"
command -v python3 >/dev/null || { echo "python3 is needed (it ships with Debian/Ubuntu)" >&2; exit 1; }
as_root python3 hack/hugepages.py reserve
phase_end

# ---- 1. system packages --------------------------------------------------------------------
phase_start "system packages"
need=()
command -v python3 >/dev/null || need+=(python3 python3-venv)
# Debian's python3 can import `venv` yet cannot create one without python3-venv (no
# ensurepip wheels): try it for real when .venv does not exist yet.
if [ ! -x .venv/bin/python ] && command -v python3 >/dev/null; then
  probe="$(mktemp -d)"
  python3 -m venv "$probe/v" >/dev/null 2>&1 || need+=(python3-venv)
  rm -rf "$probe"
fi
command -v openssl >/dev/null || need+=(openssl)
command -v setpriv >/dev/null || need+=(util-linux)
[ -e /etc/ssl/certs/ca-certificates.crt ] || need+=(ca-certificates)
if [ "${#need[@]}" -gt 0 ]; then
  if ! command -v apt-get >/dev/null; then
    echo "missing ${need[*]} and no apt-get to install them" >&2; exit 1
  fi
  echo "installing: ${need[*]}" >&2
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}"
fi
phase_end

# ---- 2. Go -----------------------------------------------------------------------------------
phase_start "go toolchain"
go_ok() {
  command -v go >/dev/null || return 1
  local v; v="$(GOTOOLCHAIN=local go env GOVERSION 2>/dev/null)" || return 1
  python3 - "$v" "$GO_MIN_MINOR" <<'EOF'
import re, sys
m = re.match(r"go(\d+)\.(\d+)", sys.argv[1])
sys.exit(0 if m and (int(m[1]), int(m[2])) >= (1, int(sys.argv[2])) else 1)
EOF
}
if ! go_ok; then
  # An older Go (>= 1.21) switches toolchains itself: GOTOOLCHAIN makes the go command fetch
  # the pinned release through the Go module proxy it is configured with, verified against
  # the checksum database. We then put that toolchain first on PATH.
  command -v go >/dev/null || { echo "no Go on PATH: install Go >= 1.21 (this machine kind ships one)" >&2; exit 1; }
  GOROOT_PINNED="$(GOTOOLCHAIN="go$GO_BOOTSTRAP_VERSION" go env GOROOT)"
  export PATH="$GOROOT_PINNED/bin:$PATH"
  go_ok || { echo "could not switch to go$GO_BOOTSTRAP_VERSION (GOROOT $GOROOT_PINNED)" >&2; exit 1; }
fi
echo "using $(GOTOOLCHAIN=local go version) at $(command -v go)" >&2
phase_end

# ---- 3. Python environment ---------------------------------------------------------------------
phase_start "python venv + install"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# Re-install only when the dependency declaration changed (editable install: code changes
# need nothing). The stamp lives inside .venv, so a new venv always installs.
stamp=".venv/.offloadpool-install.sha256"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! .venv/bin/python -c 'import offloadpool' 2>/dev/null; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[test]'
  echo "$want" > "$stamp"
else
  echo "pyproject.toml unchanged since the last install; skipping pip" >&2
fi
phase_end

# ---- 3b. the pinned vLLM (its own venv under $OFFLOADPOOL_CACHE; once, then a stamp check) ------
phase_start "pinned vLLM env"
.venv/bin/python hack/vllm_env.py ensure >/dev/null
phase_end

# ---- 4. control plane binaries -----------------------------------------------------------------
phase_start "control plane build"
.venv/bin/python hack/controlplane.py build
phase_end

# ---- 5. tests ----------------------------------------------------------------------------------
phase_start "pytest"
REPORT_DIR="$(mktemp -d)"
report="$REPORT_DIR/junit.xml"
set +e
.venv/bin/python -m pytest --junitxml="$report" "$@"
rc=$?
set -e
phase_end
if [ "$rc" -eq 5 ]; then
  echo "FAIL: no test ran (pytest exit 5)" >&2
  exit 1
fi
if [ "$rc" -ne 0 ]; then
  echo "FAIL: pytest exited $rc" >&2
  exit "$rc"
fi
# Skips and xfails are not allowed anywhere (only gpu tests may be deselected, which is not a skip).
.venv/bin/python - "$report" <<'EOF'
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root)
ran = sum(int(s.get("tests", 0)) for s in suites)
skipped = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s.iter("testcase")
           if c.find("skipped") is not None]
if ran == 0:
    sys.exit("FAIL: no test ran")
if skipped:
    sys.exit("FAIL: skipped/xfailed tests are not allowed:\n  " + "\n  ".join(skipped))
print(f"OK: {ran} tests ran, none skipped", file=sys.stderr)
EOF
