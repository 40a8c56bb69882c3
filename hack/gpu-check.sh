#!/usr/bin/env bash
# The GPU check, one prepared run (about 10 minutes):  sudo bash hack/gpu-check.sh
#
# For a machine with an NVIDIA GPU (and PyPI reachable for the first run). It
#   1. installs the pinned vLLM (hack/vllm_env.py: CUDA torch and the CUDA libraries it links),
#   2. adds what the gpu tests need on top of it, into a directory of its own next to that
#      environment (cuda-python for offloadpool's cuda backend, pytest), never into it,
#   3. runs every test marked `gpu` (found with grep, so no other test module is imported) with
#      that Python: real cuMemHostRegister, real copies, vLLM's own worker moving blocks
#      GPU <-> pool,
#   4. runs `offloadpool bench startup --backend cuda` (what an engine pays at start-up: building
#      its region itself vs attaching a pool, pinned with the driver API; then 4 workers at once
#      registering their share of one pool, per-rank vs interleaved vs whole-region), and prints it.
# Output goes to stdout and to $OUT_DIR (default: a temp dir): gpu-tests.xml, bench-startup.json/.md.
# (The bench runs as `python -m offloadpool.bench.startup`, which is `offloadpool bench startup`
# without the CLI's other commands and their imports: the library and the bench are stdlib-only.)
# Exits non-zero if a test failed, none ran, the GPU is not visible, or the vLLM test could not run.
#
# OFFLOADPOOL_VLLM_PYTHON=<python> skips step 1-2: that interpreter already imports vLLM 0.33.0,
# torch and cuda-python (e.g. a GPU machine handed vLLM without a registry) and runs every test.
#
# A GPU machine that cannot reach PyPI (GPU_CHECK_VLLM=off, or `ensure` failing) still runs
# steps 3-4 for everything but vLLM, with the machine's own python3 (it must import torch and
# cuda-python and pydantic, the one package the library's api contract needs), then exits 1
# saying the vLLM test did not run: the pinned vLLM and its torch are several GB and cannot be
# carried onto such a machine, so only a machine with PyPI proves that test.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export OFFLOADPOOL_CACHE="${OFFLOADPOOL_CACHE:-/var/cache/offloadpool}"
OUT_DIR="${OUT_DIR:-$(mktemp -d)}"
mkdir -p "$OUT_DIR"
CAPACITY="${BENCH_CAPACITY:-8Gi}"
REPS="${BENCH_REPS:-3}"

nvidia-smi -L || { echo "no NVIDIA GPU visible (nvidia-smi -L failed)" >&2; exit 1; }

PY=""
MARK="gpu"
VLLM_MISSING=""
if [ -n "${OFFLOADPOOL_VLLM_PYTHON:-}" ]; then
  # vLLM put there some other way (tests/fixtures/vllm_env.py reads the same variable): its
  # interpreter runs every gpu test, vLLM's included
  PY="$OFFLOADPOOL_VLLM_PYTHON"
  echo "==> vLLM from OFFLOADPOOL_VLLM_PYTHON=$PY" >&2
  "$PY" -c "import vllm, torch; from cuda.bindings import driver; print('vllm', vllm.__version__, 'torch', torch.__version__, torch.cuda.get_device_name(0))" >&2
  export PYTHONPATH="$ROOT/agent${PYTHONPATH:+:$PYTHONPATH}"
elif [ "${GPU_CHECK_VLLM:-auto}" != off ]; then
  echo "==> pinned vLLM" >&2
  if VLLM_PY="$(python3 hack/vllm_env.py ensure)"; then
    PY="$VLLM_PY"
    EXTRAS="$(dirname "$(dirname "$(dirname "$VLLM_PY")")")/gpu-check-extras"
    if [ ! -f "$EXTRAS/.done" ]; then
      echo "==> gpu test extras into $EXTRAS" >&2
      rm -rf "$EXTRAS"
      # cuda-bindings/cuda-pathfinder at the versions torch 2.14.0 resolves to (hack/vllm-requirements.txt's torch)
      "$VLLM_PY" -m pip install -q --disable-pip-version-check --target "$EXTRAS" \
        cuda-bindings==13.5.0 cuda-pathfinder==1.9.1 pytest pytest-timeout hypothesis
      touch "$EXTRAS/.done"
    fi
    export PYTHONPATH="$ROOT/agent:$EXTRAS"
  else
    VLLM_MISSING="hack/vllm_env.py ensure failed (output above)"
  fi
else
  VLLM_MISSING="GPU_CHECK_VLLM=off"
fi
if [ -z "$PY" ]; then
  PY="$(command -v python3)"
  MARK="gpu and not vllm"
  echo "==> without vLLM ($VLLM_MISSING): $PY runs the gpu tests not marked vllm" >&2
  "$PY" -c "import torch, pytest; from cuda.bindings import driver; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" >&2
  export PYTHONPATH="$ROOT/agent${PYTHONPATH:+:$PYTHONPATH}"
fi

# The suite's huge pages first, as hack/test.sh does: the vLLM test's pool root draws on that
# kept reservation, and the leak guard counts it as the machine's, not as the test's leak.
echo "==> the suite's huge page reservation (hack/hugepages.py reserve)" >&2
python3 hack/hugepages.py reserve

mapfile -t GPU_TESTS < <(grep -l "pytest.mark.gpu" tests/test_*.py)
echo "==> gpu tests: ${GPU_TESTS[*]}" >&2
set +e
"$PY" -m pytest -p no:cacheprovider -m "$MARK" -v --junitxml="$OUT_DIR/gpu-tests.xml" "${GPU_TESTS[@]}"
rc=$?
set -e

echo "==> offloadpool bench startup --backend cuda --capacity $CAPACITY --reps $REPS" >&2
"$PY" -m offloadpool.bench.startup --backend cuda --capacity "$CAPACITY" --reps "$REPS" --json \
  --markdown "$OUT_DIR/bench-startup.md" \
  | tee "$OUT_DIR/bench-startup.json"

echo "==> results in $OUT_DIR" >&2
if [ "$rc" -eq 5 ]; then echo "FAIL: no gpu test ran" >&2; exit 1; fi
if [ "$rc" -eq 0 ] && [ -n "$VLLM_MISSING" ]; then
  echo "FAIL: the vllm gpu test did not run ($VLLM_MISSING); every other gpu test passed" >&2
  exit 1
fi
exit "$rc"
