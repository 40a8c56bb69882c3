#!/usr/bin/env bash
# The one test command:  bash hack/test.sh [pytest args...]
# The fast lane:         bash hack/test.sh --fast [pytest args...]
#
# On a fresh Debian/Ubuntu machine (as root, with only package registries reachable) it
#   0. reserves the huge pages the suite needs (hack/hugepages.py) before anything else, while
#      memory is still unfragmented, and keeps them for later runs (give them back with
#      `python3 hack/hugepages.py release`); it stops at once, with one message, if it cannot,
#   1. installs missing system packages (python3-venv, openssl, ...) with apt-get,
#   2. finds Go >= 1.26, or has an older go command switch to the pinned release
#      (GOTOOLCHAIN, fetched through the Go module proxy),
#   3. creates/updates .venv with `pip install -e '.[test]'`,
#   3a. lints: ruff check, ruff format --check, mypy ([tool.ruff], [tool.mypy] in pyproject.toml)
#      hack/sync_chart.py --check (the chart's CRDs and RBAC are crds/'s and deploy/'s) and
#      hack/release.py check (the version's homes agree), in seconds, before anything slow; a
#      finding fails the run (after the tests have run too),
#   3b. installs the pinned vLLM the vllm tests drive into a venv cached outside the clone
#      (hack/vllm_env.py, docs/vllm.md),
#   3c. installs the pinned LMCache the lmcache tests drive, layered on that venv
#      (hack/vllm_env.py --engine lmcache, docs/lmcache.md),
#   3d. the same for the pinned SGLang the sglang tests drive (hack/vllm_env.py --engine sglang,
#      docs/sglang.md; it reuses vLLM's torch pins, so pip serves torch from its cache),
#   4. builds the real control plane (etcd, kube-apiserver, kube-controller-manager, kubectl,
#      helm) into ${OFFLOADPOOL_CACHE:-/var/cache/offloadpool} — once; later runs reuse it,
#   4b. builds the real node (kubelet, kube-scheduler, containerd, CNI, runc, images) the same way
#      (python3 -m hack.node build),
#   5. runs the whole suite: .venv/bin/python -m pytest "$@".
# It exits non-zero if the lint phase had a finding, if any test fails, if no test ran, or if any
# test was skipped or xfailed
# (the project's rule: a test that cannot run must fail, never skip).
# Wall time of every phase is printed at the end. See docs/testing.md.
#
# --fast is the edit-test loop: the venv (phase 3) if it is missing or stale, the lint phase, and
# every test that needs no control plane, no Go, no root and no GPU (by marker: tests/conftest.py
# marks tests from the fixtures they use), all in about a minute. It reserves no huge pages,
# installs no system package, builds nothing, and runs as any user. Lint findings and test
# failures are both reported; either makes it exit non-zero.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

FAST=0
if [ "${1:-}" = "--fast" ]; then
  FAST=1
  shift
fi
#: the tests the fast lane runs: every marker that needs something it does not have, deselected
FAST_MARKERS="not controlplane and not e2e and not chaos and not vllm and not sglang and not gpu and not root and not node"

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

command -v python3 >/dev/null || { echo "python3 is needed (it ships with Debian/Ubuntu)" >&2; exit 1; }

# ---- 0. huge pages -------------------------------------------------------------------------
# First, before any build or install fragments memory: a 1 GiB page needs a contiguous GiB.
reserve_hugepages() {
  phase_start "huge page reservation"
  as_root python3 hack/hugepages.py reserve
  phase_end
}

# ---- 1. system packages --------------------------------------------------------------------
system_packages() {
  phase_start "system packages"
  local need=()
  command -v python3 >/dev/null || need+=(python3 python3-venv)
  # Debian's python3 can import `venv` yet cannot create one without python3-venv (no
  # ensurepip wheels): try it for real when .venv does not exist yet.
  if [ ! -x .venv/bin/python ] && command -v python3 >/dev/null; then
    local probe
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
}

# ---- 2. Go -----------------------------------------------------------------------------------
go_ok() {
  command -v go >/dev/null || return 1
  local v; v="$(GOTOOLCHAIN=local go env GOVERSION 2>/dev/null)" || return 1
  python3 - "$v" "$GO_MIN_MINOR" <<'PY'
import re, sys
m = re.match(r"go(\d+)\.(\d+)", sys.argv[1])
sys.exit(0 if m and (int(m[1]), int(m[2])) >= (1, int(sys.argv[2])) else 1)
PY
}
go_toolchain() {
  phase_start "go toolchain"
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
}

# ---- 3. Python environment ---------------------------------------------------------------------
python_env() {
  phase_start "python venv + install"
  if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
  fi
  # Re-install only when the dependency declaration changed (editable install: code changes
  # need nothing). The stamp lives inside .venv, so a new venv always installs.
  local stamp=".venv/.offloadpool-install.sha256" want
  want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! .venv/bin/python -c 'import offloadpool' 2>/dev/null; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e '.[test]'
    echo "$want" > "$stamp"
  else
    echo "pyproject.toml unchanged since the last install; skipping pip" >&2
  fi
  phase_end
}

# ---- 3a. lint: seconds, so before anything slow -------------------------------------------------
# Prints every finding of every linter; returns non-zero if any had one.
lint() {
  phase_start "lint"
  local failed=()
  .venv/bin/ruff check --output-format concise . || failed+=("ruff check")
  .venv/bin/ruff format --check --output-format concise . || failed+=("ruff format --check (run: .venv/bin/ruff format .)")
  .venv/bin/mypy || failed+=("mypy")
  python3 hack/sync_chart.py --check || failed+=("hack/sync_chart.py --check (run: python3 hack/sync_chart.py)")
  python3 hack/release.py check || failed+=("hack/release.py check (the version's homes disagree)")
  phase_end
  if [ "${#failed[@]}" -gt 0 ]; then
    printf 'FAIL: lint: %s\n' "${failed[@]}" >&2
    return 1
  fi
}

# ---- 3b. the pinned vLLM (its own venv under $OFFLOADPOOL_CACHE; once, then a stamp check) ------
vllm_env() {
  phase_start "pinned vLLM env"
  .venv/bin/python hack/vllm_env.py ensure >/dev/null
  phase_end
}

# ---- 3c. the pinned LMCache (same mechanism, a small venv layered on the vLLM one) --------------
lmcache_env() {
  phase_start "pinned LMCache env"
  .venv/bin/python hack/vllm_env.py --engine lmcache ensure >/dev/null
  phase_end
}

# ---- 3d. the pinned SGLang (same mechanism, its pin; reuses vLLM's torch, from pip's cache) ----
sglang_env() {
  phase_start "pinned SGLang env"
  .venv/bin/python hack/vllm_env.py --engine sglang ensure >/dev/null
  phase_end
}

# ---- 4. control plane binaries -----------------------------------------------------------------
control_plane_build() {
  phase_start "control plane build"
  .venv/bin/python -m hack.controlplane build
  phase_end
}

# ---- 4b. real node binaries --------------------------------------------------------------------
# kubelet, kube-scheduler, containerd, the CNI plugins, runc and busybox (apt), the pause and
# busybox images (hack/node_build.py, docs/real-node.md "The test node"): the node the `node` tests
# run pods on. Built once into its own cache; later runs take well under a second.
node_build() {
  phase_start "node binaries"
  .venv/bin/python -m hack.node build
  phase_end
}

# ---- 4c. the chart's image ----------------------------------------------------------------------
# hack/image.py: a debootstrap base (cached per recipe) and the Dockerfile's install run in a
# chroot, written as an OCI image layout keyed by the content of the source (docs/real-node.md,
# "The image"). First run ~4 min; after a change of pyproject.toml ~1 min (the dependency
# layer); after any other source change ~4 s; unchanged 0.2 s.
image_build() {
  phase_start "image build"
  as_root python3 hack/image.py build >/dev/null
  phase_end
}

# ---- 5. tests ----------------------------------------------------------------------------------
# Runs pytest with the given arguments; fails if a test failed, none ran, or any was skipped.
run_pytest() {
  phase_start "pytest"
  REPORT_DIR="$(mktemp -d)"
  local report="$REPORT_DIR/junit.xml" rc
  set +e
  .venv/bin/python -m pytest --junitxml="$report" "$@"
  rc=$?
  set -e
  phase_end
  if [ "$rc" -eq 5 ]; then
    echo "FAIL: no test ran (pytest exit 5)" >&2
    return 1
  fi
  if [ "$rc" -ne 0 ]; then
    echo "FAIL: pytest exited $rc" >&2
    return "$rc"
  fi
  # Skips and xfails are not allowed anywhere (only gpu tests may be deselected, which is not a skip).
  .venv/bin/python - "$report" <<'PY'
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
PY
}

# Lint findings are printed within seconds and fail the run, but the tests still run: one run
# shows both, and a formatting slip does not hide a test result.
lint_rc=0
tests_rc=0
if [ "$FAST" -eq 1 ]; then
  python_env
  lint || lint_rc=$?
  run_pytest -m "$FAST_MARKERS" "$@" || tests_rc=$?
else
  reserve_hugepages
  system_packages
  go_toolchain
  python_env
  lint || lint_rc=$?
  vllm_env
  lmcache_env
  sglang_env
  control_plane_build
  node_build
  image_build
  run_pytest "$@" || tests_rc=$?
fi
[ "$lint_rc" -eq 0 ] || echo "FAIL: the lint phase had findings (printed before the tests)" >&2
[ "$tests_rc" -eq 0 ] || exit "$tests_rc"
exit "$lint_rc"
