#!/usr/bin/env python3
"""Every engine served end to end on a GPU: vLLM with the native spec, SGLang with the plugin.

    <engine python> hack/serve_check.py make-model DIR [--seed N]
        a tiny Llama-shaped model made here (no download): config.json, generation_config.json,
        model.safetensors (random weights at a fixed seed), tokenizer.json + tokenizer_config.json
        (a byte-level BPE trained on a built-in text); needs torch, transformers, tokenizers and
        safetensors (every engine environment has them)
    python3 hack/serve_check.py serve vllm|sglang --python PY --model DIR (--pool-dir DIR | --no-pool)
            [--tier-bytes N] [--json FILE] ...
        start the engine's own server on 127.0.0.1 (``vllm serve`` with kv_transfer_config's
        OffloadingConnector, or ``python -m sglang.launch_server`` with HiCache), time it to
        ready, decode the same prompts greedily twice -- computed, then after the GPU prefix cache
        was emptied, from the host tier -- and compare the token ids, read the engine's own
        offload metrics, stop the server and print a JSON summary
    python3 hack/serve_check.py python vllm|sglang [--candidate PY]
        an interpreter that can serve the pinned engine: the candidate when it can, else the
        engine's full install (``pip install vllm==0.33.0`` / ``sglang==0.5.23`` with its
        dependencies, plus the CLI's rich and PyYAML) in
        ``$OFFLOADPOOL_CACHE/serve/<engine>-<version>-py<XY>/venv``, built once (PyPI needed
        then) and stamped after an import probe. The pinned environments of hack/vllm_env.py
        are CPU import subsets (no uvicorn, no CUDA kernels): they cannot serve.
    python3 hack/serve_check.py verdict RESULT.json ...
        one line per run and per engine; exit 1 on a token mismatch, a run without offload hits,
        or a run that did not finish

``--pool-dir`` serves the host tier from a provisioned pool (vLLM: ``OffloadPoolOffloadingSpec``;
SGLang: ``OFFLOADPOOL_POOL_DIR`` and the ``sglang.srt.plugins`` entry point); ``--no-pool`` runs
the same engine with its own host tier of the same size (vLLM's ``CPUOffloadingSpec`` with
``cpu_bytes_to_use``; SGLang's own ``--hicache-size`` allocation), so the two time-to-ready
figures differ only in where the tier comes from.

How the GPU cache is emptied while the host tier keeps the KV, per engine (read from the pinned
code; docs/testing.md#served-end-to-end-on-a-gpu):

* vLLM 0.33.0: ``POST /reset_prefix_cache`` (``VLLM_SERVER_DEV_MODE=1``) resets the GPU prefix
  cache only; the connector's cache is reset only with ``reset_external=true``, which is not
  sent. It answers ``success: false`` while offload stores still hold blocks, so it is retried.
* SGLang 0.5.23: ``/flush_cache`` is not usable: ``UnifiedRadixCache.reset`` also clears the host
  pool (``cache_controller.mem_pool_host.clear()``). The device cache is made small
  (``--max-total-tokens``) and filler prompts push the measured prompts' nodes out of it; with
  ``--hicache-write-policy write_through`` their KV was backed up to the host first (the check
  waits for ``sglang:hicache_backup_tokens_total`` to cover them), so the re-sent prompts load
  back from the host.

Both engines run their deterministic modes (vLLM ``VLLM_BATCH_INVARIANT=1``; SGLang
``--enable-deterministic-inference``): a prefix that comes back from any cache changes the
shapes the remaining tokens are computed in, and a random-weight model's logits are close enough
that a shape-dependent rounding could flip a greedy choice; those modes exist to make the result
independent of the batch shape. ``--no-deterministic`` turns them off.

Standard library only, but for ``make-model`` (run with an engine's Python) and the model check.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ENGINES = ("vllm", "sglang")
VERSIONS = {"vllm": "0.33.0", "sglang": "0.5.23"}

# -- the model -----------------------------------------------------------------------------------

#: the tiny model's shape: Llama, two layers, GQA (4 query heads, 2 KV heads of 64)
MODEL_SHAPE: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
VOCAB_TARGET = 1024
SPECIAL = ("<s>", "</s>")
#: KV bytes one token takes in the model (K and V, every layer, bf16): what sizes the tiers
KV_BYTES_PER_TOKEN = 2 * MODEL_SHAPE["num_hidden_layers"] * MODEL_SHAPE["num_key_value_heads"] * 64 * 2
#: the text the tokenizer is trained on: any text does, this one is the project's own words
CORPUS = """\
An offload pool is memory a node provisions and pre-faults before an engine starts, so the engine
attaches it instead of allocating and faulting its own host tier. The KV cache of a prompt is
stored from the GPU into the pool, and when the same prefix comes back the engine loads it from
the pool instead of computing it again. The node owns the pages; the engine holds a lease while it
runs, and the node neither scrubs nor reshapes a pool under a lease. A pool is laid out Replicated,
Interleaved or PerRank, on Memory, MemoryTHP or huge pages, and serves the next model, block size,
dtype or tensor parallel size on the node without being provisioned again.
"""


def make_model(out: Path, seed: int = 0) -> dict[str, Any]:
    """Write the tiny model to ``out``; return a summary (files, vocabulary, parameter count).

    Weights are drawn explicitly, parameter by parameter in name order, from one seeded
    generator (never transformers' initialisation, whose order may change between versions):
    embeddings N(0, 1), every linear layer N(0, 1/fan_in), norms 1. With these scales attention
    and the MLP move the residual stream as much as the token's own embedding does, so the next
    token depends on the context -- on the KV -- and not on the last token alone."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_TARGET,
        special_tokens=list(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([CORPUS] * 4, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=SPECIAL[0], eos_token=SPECIAL[1])
    tok.model_max_length = MODEL_SHAPE["max_position_embeddings"]
    tok.save_pretrained(out)
    vocab = bpe.get_vocab_size()
    bos, eos = (bpe.token_to_id(t) for t in SPECIAL)

    config = LlamaConfig(vocab_size=vocab, bos_token_id=bos, eos_token_id=eos, **MODEL_SHAPE)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif "embed_tokens" in name:
                param.copy_(torch.randn(param.shape, generator=gen))
            else:
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
    model = model.to(torch.bfloat16)
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)
    files = sorted(p.name for p in out.iterdir() if p.is_file())
    return {
        "dir": str(out),
        "files": files,
        "vocab_size": vocab,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "parameters": sum(p.numel() for p in model.parameters()),
        "seed": seed,
    }


def prompts(
    vocab_size: int, count: int, length: int, seed: int, avoid: Sequence[int] = ()
) -> list[list[int]]:
    """``count`` prompts of ``length`` token ids drawn at ``seed`` (no special token): sent as ids,
    so what the engines decode does not depend on the tokenizer."""
    rng = random.Random(seed)
    pool = [t for t in range(vocab_size) if t not in set(avoid)]
    return [[rng.choice(pool) for _ in range(length)] for _ in range(count)]


# -- the engines' metrics --------------------------------------------------------------------------

#: the counters that show the host tier served a prefix, as the pinned engines name them
#: (prometheus_client adds ``_total`` to a counter's name in the exposition)
HIT_METRICS: dict[str, dict[str, tuple[str, dict[str, str]]]] = {
    "vllm": {
        # vllm/v1/metrics/loggers.py (PrometheusStatLogger): tokens the connector found
        "external_prefix_cache_hits": ("vllm:external_prefix_cache_hits_total", {}),
        # vllm/distributed/kv_transfer/kv_connector/v1/offloading/metrics.py (_TransferMetricName)
        "kv_offload_load_bytes": ("vllm:kv_offload_load_bytes_total", {}),
        "kv_offload_store_bytes": ("vllm:kv_offload_store_bytes_total", {}),
    },
    "sglang": {
        # sglang/srt/observability/metrics_collector.py (TokenizerMetricsCollector)
        "cached_tokens_host": ("sglang:cached_tokens_total", {"cache_source": "host"}),
        "cached_tokens_device": ("sglang:cached_tokens_total", {"cache_source": "device"}),
        # the same file (RadixCacheMetricsCollector): host -> GPU and GPU -> host
        "load_back_tokens": ("sglang:load_back_tokens_total", {"pool": "kv"}),
        "hicache_backup_tokens": ("sglang:hicache_backup_tokens_total", {"pool": "kv"}),
    },
}
#: which of them must grow while the prompts come back for the run to count as served from the tier
REQUIRED_HITS = {
    "vllm": ("external_prefix_cache_hits", "kv_offload_load_bytes"),
    "sglang": ("cached_tokens_host", "load_back_tokens"),
}

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\d+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text exposition -> (name, labels, value) per sample; comments skipped."""
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        labels = {k: bytes(v, "utf-8").decode("unicode_escape") for k, v in _LABEL.findall(m.group(3) or "")}
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        samples.append((m.group(1), labels, value))
    return samples


def metric_sum(
    samples: Sequence[tuple[str, dict[str, str], float]], name: str, labels: Mapping[str, str]
) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (every engine, every rank)."""
    return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items()))


def hit_counters(engine: str, text: str) -> dict[str, float]:
    samples = parse_metrics(text)
    return {key: metric_sum(samples, name, labels) for key, (name, labels) in HIT_METRICS[engine].items()}


def delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


# -- comparing what came back ------------------------------------------------------------------------


def first_mismatch(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> dict[str, Any] | None:
    """None when both passes decoded the same ids for every prompt; else where they first differ."""
    if len(a) != len(b):
        return {"prompt": None, "reason": f"{len(a)} outputs against {len(b)}"}
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if list(x) != list(y):
            at = next((j for j, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y)))
            return {"prompt": i, "token": at, "a": list(x[at : at + 4]), "b": list(y[at : at + 4])}
    return None


@dataclass
class RunResult:
    engine: str
    pool: str | None  # the pool directory, or None: the engine's own host tier
    ok: bool = False
    reason: str = ""
    ready_s: float | None = None
    computed: list[list[int]] = field(default_factory=list)
    from_tier: list[list[int]] = field(default_factory=list)
    mismatch: dict[str, Any] | None = None
    hits: dict[str, float] = field(default_factory=dict)
    cached_tokens: list[int | None] = field(default_factory=list)
    evict: str = ""
    command: list[str] = field(default_factory=list)
    log: str = ""

    def judge(self) -> RunResult:
        """ok when both passes agree and every required counter grew; reason says what failed."""
        self.mismatch = first_mismatch(self.computed, self.from_tier)
        missing = [k for k in REQUIRED_HITS[self.engine] if self.hits.get(k, 0.0) <= 0]
        problems = []
        if not self.computed:
            problems.append("no output")
        if self.mismatch is not None:
            problems.append(f"tokens differ: {json.dumps(self.mismatch)}")
        if missing:
            problems.append(f"no offload hits: {', '.join(missing)} did not grow")
        self.ok = not problems
        self.reason = "; ".join(problems)
        return self


def load_result(path: Path) -> dict[str, Any]:
    """A run's JSON; a run that wrote none (killed by the outer timeout) is a failed run, named by
    its file (``<engine>-<pool|own>.json``)."""
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError) as e:
        engine, _, tier = path.stem.partition("-")
        return {
            "engine": engine,
            "pool": "?" if tier == "pool" else None,
            "ok": False,
            "reason": f"no result in {path} ({type(e).__name__}): the run did not finish",
        }


def verdict_lines(results: Sequence[Mapping[str, Any]]) -> tuple[list[str], bool]:
    """One line per run; and whether every run passed."""
    lines, ok = [], True
    for r in results:
        tier = f"pool {r['pool']}" if r.get("pool") else "its own host tier"
        ready = f"ready in {r['ready_s']:.1f} s" if r.get("ready_s") is not None else "never ready"
        hits = ", ".join(f"{k} +{v:.0f}" for k, v in sorted((r.get("hits") or {}).items()))
        state = "PASS" if r.get("ok") else f"FAIL ({r.get('reason') or 'no result'})"
        lines.append(f"{r['engine']:6} {tier}: {ready}; {hits or 'no metrics'}: {state}")
        ok = ok and bool(r.get("ok"))
    for engine in ENGINES:
        times = {bool(r.get("pool")): r.get("ready_s") for r in results if r["engine"] == engine}
        if times.get(True) is not None and times.get(False) is not None:
            lines.append(
                f"{engine:6} time to ready: {times[False]:.1f} s with its own host tier, "
                f"{times[True]:.1f} s with the pool"
            )
    return lines, ok


# -- the servers ---------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(method: str, url: str, body: Any = None, timeout: float = 60) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def plugin_dist(dest: Path) -> Path:
    """A sys.path directory with a dist-info carrying pyproject.toml's ``sglang.srt.plugins``
    entry point, so SGLang's ``load_plugins()`` finds offloadpool's plugin without offloadpool
    being installed into SGLang's environment (the clone's agent/ is on PYTHONPATH)."""
    text = (REPO / "pyproject.toml").read_text()
    section = text.split('[project.entry-points."sglang.srt.plugins"]', 1)[1].split("\n[", 1)[0]
    group = dict(re.findall(r'^\s*([\w.-]+)\s*=\s*"([^"]+)"', section, re.M))
    info = dest / "offloadpool_serve_check-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: offloadpool-serve-check\nVersion: 0\n")
    lines = ["[sglang.srt.plugins]", *(f"{k} = {v}" for k, v in group.items()), ""]
    (info / "entry_points.txt").write_text("\n".join(lines))
    return dest


@dataclass
class Plan:
    """What one run starts and sends: the command, its environment, and the endpoints."""

    argv: list[str]
    env: dict[str, str]
    base: str
    ready_path: str


def engine_plan(args: argparse.Namespace, port: int, scratch: Path) -> Plan:
    py = str(args.python)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "agent"), os.environ.get("PYTHONPATH", "")])),
    }
    env.pop("OFFLOADPOOL_POOL_DIR", None)
    base = f"http://127.0.0.1:{port}"
    if args.engine == "vllm":
        if args.pool_dir:
            extra: dict[str, Any] = {
                "spec_name": "OffloadPoolOffloadingSpec",
                "spec_module_path": "offloadpool.vllm.spec",
                "pool_dir": str(args.pool_dir),
            }
        else:
            extra = {"cpu_bytes_to_use": args.tier_bytes}
        kv = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
        env["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache
        if args.deterministic:
            env["VLLM_BATCH_INVARIANT"] = "1"
        argv = [
            py, "-m", "vllm.entrypoints.cli.main", "serve", str(args.model),
            "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
            "--dtype", args.dtype, "--max-model-len", "2048", "--block-size", "16",
            "--gpu-memory-utilization", str(args.gpu_memory_utilization),
            "--enforce-eager", "--enable-prompt-tokens-details", "--seed", "0",
            "--kv-transfer-config", json.dumps(kv),
        ]  # fmt: skip
        return Plan(argv, env, base, "/health")
    # SGLang: HiCache with write-through, a small device cache the fillers can overflow
    if args.pool_dir:
        env["OFFLOADPOOL_POOL_DIR"] = str(args.pool_dir)
        env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(plugin_dist(scratch / "plugins"))])
    hicache_gb = max(1, args.tier_bytes // 2 // 10**9)  # SGLang's GB are 1e9 bytes; half the tier
    argv = [
        py, "-m", "sglang.launch_server", "--model-path", str(args.model),
        "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
        "--dtype", args.dtype, "--context-length", "2048", "--random-seed", "0",
        "--mem-fraction-static", str(args.gpu_memory_utilization),
        "--max-total-tokens", str(args.device_tokens), "--enable-metrics",
        "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled",
        "--enable-hierarchical-cache", "--hicache-write-policy", "write_through",
        "--hicache-size", str(hicache_gb), "--attention-backend", args.sglang_attention_backend,
    ]  # fmt: skip
    if args.deterministic:
        argv.append("--enable-deterministic-inference")
    return Plan(argv, env, base, "/health")


def generate(engine: str, base: str, ids: list[int], max_tokens: int) -> tuple[list[int], int | None]:
    """One greedy request by token ids; (output ids, cached prompt tokens the engine reported)."""
    if engine == "vllm":
        body = {
            "model": "tiny",
            "prompt": ids,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        code, text = http("POST", base + "/v1/completions", body, timeout=120)
        if code != 200:
            raise RuntimeError(f"/v1/completions answered {code}: {text[:500]}")
        out = json.loads(text)
        details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
        return list(out["choices"][0]["token_ids"]), details.get("cached_tokens")
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_tokens, "ignore_eos": True},
    }
    code, text = http("POST", base + "/generate", body, timeout=120)
    if code != 200:
        raise RuntimeError(f"/generate answered {code}: {text[:500]}")
    out = json.loads(text)
    meta = out.get("meta_info") or {}
    return list(out["output_ids"]), meta.get("cached_tokens")


def evict_gpu(engine: str, base: str, args: argparse.Namespace, measured: int, deadline: float) -> str:
    """Empty the GPU prefix cache so the measured prompts can only come back from the host tier."""
    if engine == "vllm":
        tries = 0
        while time.monotonic() < deadline:
            tries += 1
            code, text = http("POST", base + "/reset_prefix_cache", timeout=30)
            if code == 200 and json.loads(text).get("success"):
                return f"POST /reset_prefix_cache: success after {tries} call(s)"
            time.sleep(0.5)
        raise RuntimeError("POST /reset_prefix_cache never succeeded (offload stores still holding blocks?)")
    # SGLang: wait until the measured prompts are backed up to the host, then overflow the device
    while time.monotonic() < deadline:
        text = http("GET", base + "/metrics", timeout=30)[1]
        backed = hit_counters("sglang", text)["hicache_backup_tokens"]
        if backed >= measured:
            break
        time.sleep(0.5)
    else:
        raise RuntimeError(f"SGLang backed up fewer than {measured} tokens to the host before the deadline")
    n = args.device_tokens // args.prompt_len + 2
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    for ids in prompts(vocab, n, args.prompt_len, seed=args.seed + 1000, avoid=args.special_ids):
        generate(engine, base, ids, 1)
    return f"{n} filler prompts of {args.prompt_len} tokens through a {args.device_tokens}-token device cache"


def wait_ready(proc: subprocess.Popen[bytes], url: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited {proc.returncode} before it was ready")
        with contextlib.suppress(OSError):
            if http("GET", url, timeout=5)[0] == 200:
                return
        time.sleep(0.5)
    raise RuntimeError("the server was not ready before the deadline")


def stop(proc: subprocess.Popen[bytes], grace: float = 20) -> None:
    """SIGTERM the server's process group (it forks its engine and workers), then SIGKILL."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def tail(path: Path, chars: int = 4000) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")[-chars:]
    return ""


def serve(args: argparse.Namespace) -> RunResult:
    result = RunResult(args.engine, str(args.pool_dir) if args.pool_dir else None)
    config = json.loads((Path(args.model) / "config.json").read_text())
    args.special_ids = [config["bos_token_id"], config["eos_token_id"]]
    measured = prompts(config["vocab_size"], args.prompts, args.prompt_len, args.seed, avoid=args.special_ids)
    start = time.monotonic()
    deadline = start + args.timeout
    with tempfile.TemporaryDirectory(prefix=f"serve-check-{args.engine}-") as tmp:
        scratch = Path(tmp)
        plan = engine_plan(args, free_port(), scratch)
        result.command = plan.argv
        log_path = Path(args.log) if args.log else scratch / "server.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                plan.argv, stdout=log, stderr=subprocess.STDOUT, env=plan.env, start_new_session=True
            )
        try:
            wait_ready(proc, plan.base + plan.ready_path, min(deadline, start + args.ready_timeout))
            result.ready_s = round(time.monotonic() - start, 2)
            result.computed = [generate(args.engine, plan.base, ids, args.max_tokens)[0] for ids in measured]
            result.evict = evict_gpu(args.engine, plan.base, args, sum(map(len, measured)), deadline)
            before = hit_counters(args.engine, http("GET", plan.base + "/metrics", timeout=30)[1])
            for ids in measured:
                out, cached = generate(args.engine, plan.base, ids, args.max_tokens)
                result.from_tier.append(out)
                result.cached_tokens.append(cached)
            # vLLM's frontend publishes the engine's counters once per step's stats: give it a moment
            time.sleep(args.metrics_wait)
            after = hit_counters(args.engine, http("GET", plan.base + "/metrics", timeout=30)[1])
            result.hits = delta(before, after)
            result.judge()
        except (RuntimeError, OSError, KeyError, ValueError) as e:
            result.ok = False
            result.reason = f"{type(e).__name__}: {e}"
        finally:
            stop(proc)
            result.log = tail(log_path)
    return result


# -- the serving environments -------------------------------------------------------------------------

#: what must import for an interpreter to serve the pinned engine on a GPU
SERVE_PROBES = {
    "vllm": "import importlib.metadata as m, uvicorn, vllm._C, vllm.entrypoints.openai.api_server; "
    "assert m.version('vllm') == '0.33.0', m.version('vllm')",
    "sglang": "import importlib.metadata as m, uvicorn, sgl_kernel, sglang.srt.entrypoints.http_server; "
    "assert m.version('sglang') == '0.5.23', m.version('sglang')",
}


def can_serve(engine: str, python: Path | str, timeout: float = 300) -> tuple[bool, str]:
    try:
        proc = subprocess.run(
            [str(python), "-c", SERVE_PROBES[engine]], capture_output=True, text=True, timeout=timeout
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"{type(e).__name__}: {e}"
    last = (proc.stderr.strip().splitlines() or [""])[-1]
    return proc.returncode == 0, last


def serve_env_dir(engine: str) -> Path:
    cache = Path(os.environ.get("OFFLOADPOOL_CACHE", "/var/cache/offloadpool"))
    return cache / "serve" / f"{engine}-{VERSIONS[engine]}-py{sys.version_info[0]}{sys.version_info[1]}"


def ensure_serve_env(engine: str) -> Path:
    """The engine's full install, built once; its interpreter. Raises RuntimeError with pip's tail."""
    home = serve_env_dir(engine)
    python = home / "venv" / "bin" / "python"
    stamp = home / "stamp"
    if stamp.is_file() and can_serve(engine, python)[0]:
        return python
    import shutil

    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    print(f"==> {engine} {VERSIONS[engine]} (full install) into {home}", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(home / "venv")], check=True)
    pins = [f"{engine}=={VERSIONS[engine]}", "rich>=13", "PyYAML>=6"]
    pip = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--retries", "2", *pins],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if pip.returncode != 0:
        raise RuntimeError(f"pip install {' '.join(pins)} failed:\n{pip.stderr[-3000:]}")
    ok, why = can_serve(engine, python)
    if not ok:
        raise RuntimeError(f"the installed {engine} does not import: {why}")
    stamp.write_text(json.dumps({"engine": engine, "version": VERSIONS[engine], "at": time.time()}) + "\n")
    return python


# -- the command line ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="serve_check", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("make-model", help="write the tiny model (run with an engine's Python)")
    m.add_argument("dir", type=Path)
    m.add_argument("--seed", type=int, default=0)

    s = sub.add_parser("serve", help="one engine, one tier: serve, decode twice, compare, read metrics")
    s.add_argument("engine", choices=ENGINES)
    s.add_argument("--python", required=True, type=Path, help="the engine environment's interpreter")
    s.add_argument("--model", required=True, type=Path, help="a directory make-model wrote")
    tier = s.add_mutually_exclusive_group(required=True)
    tier.add_argument("--pool-dir", type=Path, help="serve the host tier from this provisioned pool")
    tier.add_argument("--no-pool", action="store_true", help="the engine's own host tier of --tier-bytes")
    s.add_argument(
        "--tier-bytes", type=int, default=1 << 30, help="the host tier's size (the pool's capacity)"
    )
    s.add_argument("--prompts", type=int, default=4)
    s.add_argument("--prompt-len", type=int, default=320, help="tokens per prompt (20 vLLM blocks)")
    s.add_argument("--max-tokens", type=int, default=24)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--dtype", default="bfloat16")
    s.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    s.add_argument("--device-tokens", type=int, default=4096, help="SGLang: --max-total-tokens")
    s.add_argument("--sglang-attention-backend", default="fa3")
    s.add_argument("--no-deterministic", dest="deterministic", action="store_false")
    s.add_argument("--timeout", type=float, default=240, help="the whole run, start to stop")
    s.add_argument("--ready-timeout", type=float, default=180)
    s.add_argument("--metrics-wait", type=float, default=2.0)
    s.add_argument("--log", help="the server's output (default: a temp file, its tail in the JSON)")
    s.add_argument("--json", type=Path, help="also write the result here")

    e = sub.add_parser("python", help="an interpreter that can serve the engine (installed if need be)")
    e.add_argument("engine", choices=ENGINES)
    e.add_argument("--candidate", help="use this interpreter when it can serve")

    v = sub.add_parser("verdict", help="judge the runs' JSON files; exit 1 unless every run passed")
    v.add_argument("results", nargs="+", type=Path)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "make-model":
        print(json.dumps(make_model(args.dir, args.seed)))
        return 0
    if args.command == "serve":
        # an outer timeout's SIGTERM unwinds through serve()'s finally, which stops the server
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
        result = asdict(serve(args))
        text = json.dumps(result, indent=2)
        if args.json:
            args.json.write_text(text + "\n")
        print(text)
        return 0 if result["ok"] else 1
    if args.command == "python":
        if args.candidate:
            ok, why = can_serve(args.engine, args.candidate)
            if ok:
                print(args.candidate)
                return 0
            print(f"{args.candidate} cannot serve {args.engine}: {why}", file=sys.stderr)
        try:
            print(ensure_serve_env(args.engine))
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            print(f"no {args.engine} to serve with: {e}", file=sys.stderr)
            return 1
        return 0
    results = [load_result(p) for p in args.results]
    lines, ok = verdict_lines(results)
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
