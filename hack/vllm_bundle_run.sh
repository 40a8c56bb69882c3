#!/usr/bin/env bash
# The GPU check with vLLM from the bundle, on a GPU machine that reaches no package registry.
# hack/vllm_bundle.py build copies this file into the bundle as run.sh. From the repo root:
#     bash .gpuvllm/run.sh                    (device tool: carry [".gpuvllm"])
# It unpacks into $VSITE (default /tmp/vsite) the cp312 wheels the machine lacks, vLLM's Python
# tree and its _C_stable_libtorch.abi3.so (fatbins cut to one GPU architecture, host code as
# built; checked against SHA256SUMS), probes that vLLM imports, then runs hack/gpu-check.sh
# with OFFLOADPOOL_VLLM_PYTHON set, and exits with its status. Log: $OUT/run.log.
# Variables: OUT (default /tmp/out), VSITE, PY (default python3: the machine's, with torch),
# REPO (default: the folder above the bundle), BUNDLE_UNPACK_ONLY=1 (stop after unpacking).
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="${REPO:-$(cd "$HERE/.." && pwd)}"
OUT="${OUT:-/tmp/out}"
VSITE="${VSITE:-/tmp/vsite}"
PY="${PY:-$(command -v python3)}"
mkdir -p "$OUT"
LOG="$OUT/run.log"
exec > >(tee -a "$LOG") 2>&1
say() { echo "=== $(date +%T) $*"; }
cd "$REPO" || exit 2

say "python: $PY ($("$PY" -V 2>&1)); nvidia-smi:"
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader 2>&1 | head -4

# -- 1. wheels: the ones the machine lacks. typing_extensions/urllib3/aiohappyeyeballs only if absent.
say "unpacking into $VSITE"
rm -rf "$VSITE" && mkdir -p "$VSITE"
wheels=()
for w in "$HERE"/whl/*.whl; do
    case "$(basename "$w")" in
    typing_extensions-*) mod=typing_extensions ;;
    urllib3-*) mod=urllib3 ;;
    aiohappyeyeballs-*) mod=aiohappyeyeballs ;;
    *) mod= ;;
    esac
    if [ -n "$mod" ] && "$PY" -c "import $mod" 2>/dev/null; then continue; fi
    wheels+=("$w")
done
if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
    --target "$VSITE" "${wheels[@]}"; then
    say "pip install --target failed; unzipping the wheels instead"
    for w in "${wheels[@]}"; do "$PY" -m zipfile -e "$w" "$VSITE" || exit 3; done
fi

# -- 2. vLLM's tree and its one needed extension (python lzma: no xz binary needed)
"$PY" - "$HERE" "$VSITE" <<'EOF' || { say "FAILED to unpack vLLM"; exit 3; }
import hashlib, lzma, shutil, sys, tarfile
here, site = sys.argv[1], sys.argv[2]
with tarfile.open(f"{here}/vllm-src.tar.xz", "r:xz") as t:
    t.extractall(site)
so = f"{site}/vllm/_C_stable_libtorch.abi3.so"
with lzma.open(f"{here}/_C_stable_libtorch.abi3.so.xz") as src, open(so, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
want = open(f"{here}/SHA256SUMS").read().split()[0]
got = hashlib.sha256(open(so, "rb").read()).hexdigest()
assert got == want, f"checksum of {so}: {got} != {want}"
print("unpacked", so)
EOF
du -sh "$VSITE"
if [ "${BUNDLE_UNPACK_ONLY:-}" = 1 ]; then
    say "unpacked (BUNDLE_UNPACK_ONLY=1: no probes, no GPU check)"
    exit 0
fi

export PYTHONPATH="$REPO/agent:$VSITE${PYTHONPATH:+:$PYTHONPATH}"  # as hack/gpu-check.sh
export OFFLOADPOOL_VLLM_PYTHON="$PY"
export CUDA_MODULE_LOADING=LAZY
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

# -- 3. probes: the .so by itself (exact loader error), then hack/vllm_env.py's PROBE imports
say "probe 1: load vllm/_C_stable_libtorch.abi3.so directly"
"$PY" - "$VSITE" <<'EOF'
import ctypes, sys, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.is_available() and torch.cuda.get_device_name(0))
so = f"{sys.argv[1]}/vllm/_C_stable_libtorch.abi3.so"
try:
    ctypes.CDLL(so, mode=ctypes.RTLD_GLOBAL)
    print("dlopen OK:", so)
except OSError as e:
    print("DLOPEN FAILED:", e)
try:
    import vllm._C_stable_libtorch  # noqa: F401
    print("import vllm._C_stable_libtorch OK; swap_blocks_batch:", torch.ops._C_cache_ops.swap_blocks_batch)
except Exception as e:
    print("IMPORT vllm._C_stable_libtorch FAILED:", type(e).__name__, e)
EOF
ldd "$VSITE/vllm/_C_stable_libtorch.abi3.so" 2>&1 | grep -E "not found" && say "(libraries above not found by ldd; torch's import may still preload them)"

say "probe 2: hack/vllm_env.py PROBE imports"
"$PY" - <<'EOF'
import traceback
try:
    import vllm, torch
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
    from vllm.v1.kv_offload.cpu.gpu_worker import CPUOffloadingWorker, pin_mmap_region
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
    import vllm._custom_ops
    assert vllm.__version__ == "0.33.0", vllm.__version__
    print("PROBE OK: vllm", vllm.__version__, "torch", torch.__version__,
          "swap_blocks_batch", hasattr(torch.ops._C_cache_ops, "swap_blocks_batch"))
except BaseException:
    print("PROBE FAILED:")
    traceback.print_exc()
EOF

# -- 4. the test
say "hack/gpu-check.sh with OFFLOADPOOL_VLLM_PYTHON=$PY"
OUT_DIR="$OUT" timeout 420 bash hack/gpu-check.sh
rc=$?
say "gpu-check exit $rc (log: $LOG)"
exit $rc
