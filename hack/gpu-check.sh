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
#      registering their share of one pool, per-rank vs interleaved vs whole-region), and prints it,
#   5. serves every engine end to end (hack/serve_check.py): a tiny Llama made here with random
#      weights (no download), `vllm serve` with the native spec and SGLang's server with the plugin,
#      each once on a pool provisioned here with `offloadpool provision` (Memory, under a temp root)
#      and once on its own host tier of the same size: the same prompts decoded greedily must give
#      the same tokens when their KV comes back from the tier (GPU cache emptied in between) as
#      when it was computed, the engine's own offload metrics must show the hits, and each run's
#      time to ready is printed. About 4-6 minutes; each run is bounded (SERVE_CHECK_RUN_TIMEOUT).
# Output goes to stdout and to $OUT_DIR (default: a temp dir): gpu-tests.xml, bench-startup.json/.md,
# serve/ (model.json, provision.json, <engine>-{pool,own}.json and .log, verdict.txt).
# (The bench runs as `python -m offloadpool.bench.startup`, which is `offloadpool bench startup`
# without the CLI's other commands and their imports: the library and the bench are stdlib-only.)
# Exits non-zero if a test failed, none ran, the GPU is not visible, the vLLM test could not run,
# or an engine's serving check failed or did not run.
#
# Step 5 needs engines that serve, which the pinned environments of step 1 (CPU import subsets) are
# not: SERVE_CHECK_VLLM_PYTHON / SERVE_CHECK_SGLANG_PYTHON name interpreters that do; otherwise the
# step-1 interpreter is tried for vLLM, and else `hack/serve_check.py python ENGINE` installs the
# engine in full (PyPI) under $OFFLOADPOOL_CACHE/serve/. They run with PYTHONPATH=$SERVE_CHECK_PYTHONPATH
# (default empty; the clone's agent/ is added for the servers). GPU_CHECK_SERVE=off skips the step
# (and the check then fails, naming it).
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

if ! nvidia-smi -L; then
  echo "no GPU: nvidia-smi -L failed, so nothing here ran: not the gpu tests, not the start-up bench," >&2
  echo "no GPU: the end-to-end serving checks (vLLM, SGLang) did not run" >&2
  exit 1
fi

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

# 5. every engine served end to end (docs/testing.md#served-end-to-end-on-a-gpu)
SERVE_DIR="$OUT_DIR/serve"
mkdir -p "$SERVE_DIR"
# the serving environments are whole: not the step-1 PYTHONPATH (its cuda-bindings, pytest) on top
SERVE_ENV=(env "PYTHONPATH=${SERVE_CHECK_PYTHONPATH:-}")
SERVE_NOT_RUN=()
SERVE_ENGINES=()
declare -A SERVE_PY=()
for engine in vllm sglang; do
  if [ "${GPU_CHECK_SERVE:-on}" = off ]; then SERVE_NOT_RUN+=("$engine (GPU_CHECK_SERVE=off)"); continue; fi
  override="SERVE_CHECK_${engine^^}_PYTHON"
  candidate="${!override:-}"
  if [ -z "$candidate" ] && [ "$engine" = vllm ]; then candidate="$PY"; fi
  echo "==> an interpreter that serves $engine${candidate:+ (trying $candidate first)}" >&2
  if p="$("${SERVE_ENV[@]}" python3 hack/serve_check.py python "$engine" ${candidate:+--candidate "$candidate"})"; then
    SERVE_PY[$engine]="$p"
    SERVE_ENGINES+=("$engine")
  else
    SERVE_NOT_RUN+=("$engine (no interpreter serves it: output above)")
  fi
done
serve_rc=0
if [ "${#SERVE_ENGINES[@]}" -gt 0 ]; then
  SERVE_ROOT="$(mktemp -d /tmp/offloadpool-serve.XXXXXX)"
  MODEL_PY="${SERVE_PY[${SERVE_ENGINES[0]}]}"
  if [ -x "$ROOT/.venv/bin/offloadpool" ]; then
    OFFLOADPOOL=("$ROOT/.venv/bin/offloadpool")
  else  # the library is stdlib-only; the CLI adds pydantic, PyYAML and rich (the serving envs have them)
    OFFLOADPOOL=(env "PYTHONPATH=$ROOT/agent" "$MODEL_PY" -m offloadpool.cli)
  fi
  serve_cleanup() {
    "${OFFLOADPOOL[@]}" release serve-check --root "$SERVE_ROOT/pools" --force >/dev/null 2>&1 || true
    rm -rf "$SERVE_ROOT"
  }
  trap serve_cleanup EXIT
  echo "==> the tiny model ($MODEL_PY hack/serve_check.py make-model)" >&2
  "${SERVE_ENV[@]}" "$MODEL_PY" hack/serve_check.py make-model "$SERVE_ROOT/model" | tee "$SERVE_DIR/model.json"
  SERVE_CAPACITY="${SERVE_CHECK_CAPACITY:-4Gi}"
  echo "==> offloadpool provision --name serve-check --capacity $SERVE_CAPACITY --medium Memory" >&2
  "${OFFLOADPOOL[@]}" provision --name serve-check --capacity "$SERVE_CAPACITY" --medium Memory \
    --root "$SERVE_ROOT/pools" --json >"$SERVE_DIR/provision.json"
  read -r POOL_DIR TIER_BYTES < <(python3 -c 'import json, sys; d = json.load(open(sys.argv[1]))
print(d["pool_dir"], d["manifest"]["total_bytes"])' "$SERVE_DIR/provision.json")
  RUN_TIMEOUT="${SERVE_CHECK_RUN_TIMEOUT:-240}"
  SERVE_RESULTS=()
  for engine in "${SERVE_ENGINES[@]}"; do
    # the pool first: a warm-cache advantage (page cache, kernel caches) goes to the engine's own tier
    for tier in pool own; do
      if [ "$tier" = pool ]; then TIER_ARGS=(--pool-dir "$POOL_DIR"); else TIER_ARGS=(--no-pool); fi
      echo "==> serve $engine on $([ "$tier" = pool ] && echo "the pool $POOL_DIR" || echo "its own host tier")" >&2
      "${SERVE_ENV[@]}" timeout --kill-after=30 "$((RUN_TIMEOUT + 60))" python3 hack/serve_check.py serve "$engine" \
        --python "${SERVE_PY[$engine]}" --model "$SERVE_ROOT/model" "${TIER_ARGS[@]}" \
        --tier-bytes "$TIER_BYTES" --timeout "$RUN_TIMEOUT" \
        --json "$SERVE_DIR/$engine-$tier.json" --log "$SERVE_DIR/$engine-$tier.log" >/dev/null || true
      SERVE_RESULTS+=("$SERVE_DIR/$engine-$tier.json")
    done
  done
  serve_cleanup
  trap - EXIT
  python3 hack/serve_check.py verdict "${SERVE_RESULTS[@]}" | tee "$SERVE_DIR/verdict.txt" || serve_rc=1
fi

echo "==> results in $OUT_DIR" >&2
for missing in "${SERVE_NOT_RUN[@]}"; do echo "FAIL: the end-to-end serving check of $missing did not run" >&2; done
if [ "$serve_rc" -ne 0 ]; then echo "FAIL: an end-to-end serving check failed ($SERVE_DIR/verdict.txt)" >&2; fi
if [ "$rc" -eq 5 ]; then echo "FAIL: no gpu test ran" >&2; exit 1; fi
if [ "$rc" -eq 0 ] && [ -n "$VLLM_MISSING" ]; then
  echo "FAIL: the vllm gpu test did not run ($VLLM_MISSING); every other gpu test passed" >&2
  exit 1
fi
if [ "$rc" -eq 0 ] && { [ "$serve_rc" -ne 0 ] || [ "${#SERVE_NOT_RUN[@]}" -gt 0 ]; }; then exit 1; fi
exit "$rc"
