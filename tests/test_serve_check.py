"""The GPU check's end-to-end serving step (hack/serve_check.py), its CPU side.

On a GPU, ``hack/gpu-check.sh`` serves the tiny model with ``vllm serve`` (native spec) and
SGLang's server (plugin), each on a pool and on its own host tier. What can be proven here, with
no GPU: the model made here loads with the engines' transformers and decodes greedily the same
every time, also when a prefix's KV is computed apart (and differently from a wrong prefix); the
metric names the check reads are the ones the pinned vLLM's and SGLang's own collectors publish;
the command lines, the comparison, the verdict and the whole client (readiness, both passes, the
eviction, metric deltas, shutdown, timeouts) against a stand-in server; and that the GPU check
says plainly, without a GPU, that the serving checks did not run.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hack import serve_check as sc
from offloadpool.sglang import PLUGIN_GROUP

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "hack" / "serve_check.py"
WORKERS = REPO / "tests" / "serve_workers"


# -- the model, with the engines' own transformers ------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("serve-model") / "tiny"
    proc = subprocess.run(
        [str(vllm_python), str(SCRIPT), "make-model", str(d)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["files"] == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    return d


def test_the_model_is_made_from_its_seed_alone(vllm_python: Path, tiny_model: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    subprocess.run([str(vllm_python), str(SCRIPT), "make-model", str(again)], check=True, capture_output=True)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (tiny_model / name).read_bytes(), name


def test_the_model_loads_and_decodes_greedily_the_same_whatever_computed_its_prefix(
    vllm_python: Path, tiny_model: Path
) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [str(vllm_python), str(WORKERS / "model_cpu.py"), str(tiny_model)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["architectures"] == ["LlamaForCausalLM"] and r["model_type"] == "llama"
    assert r["vocab_size"] == r["tokenizer_len"] and 256 < r["vocab_size"] <= 4096
    assert r["bos"][0] == r["bos"][1] and r["eos"][0] == r["eos"][1]
    assert r["round_trip"] == r["text"]
    assert r["dtype"] == "torch.bfloat16"
    assert all(len(out) == 24 for out in r["first"])
    assert r["first"] == r["second"]  # greedy is deterministic
    assert r["cached"] == r["first"]  # a prefix's KV computed apart gives the same tokens
    # the tokens depend on the KV: another prompt's prefix changes them, so a wrong load shows
    assert all(w != f for w, f in zip(r["wrong"], r["first"], strict=True))
    # and on the context, not on the last token alone: the outputs are not one token repeated
    assert all(len(set(out)) > 1 for out in r["first"])


# -- the engines' own metric names ------------------------------------------------------------------


def test_vllm_publishes_the_hits_under_the_names_the_check_reads(vllm_python: Path) -> None:
    cfg = {"queries": 1280, "hits": 1216, "load_bytes": 311296, "store_bytes": 327680}
    env = {**os.environ, "PYTHONPATH": str(REPO / "agent")}
    proc = subprocess.run(
        [str(vllm_python), str(WORKERS / "vllm_metrics.py"), json.dumps(cfg)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    hits = sc.hit_counters("vllm", proc.stdout)
    assert hits == {
        "external_prefix_cache_hits": 1216,
        "kv_offload_load_bytes": 311296,
        "kv_offload_store_bytes": 327680,
    }
    assert sc.hit_counters("vllm", "") == dict.fromkeys(hits, 0.0)


def test_sglang_publishes_the_hits_under_the_names_the_check_reads(
    sglang_python: Path, vllm_python: Path, tmp_path: Path, tiny_model: Path
) -> None:
    found = subprocess.run(
        [str(vllm_python), "-c", "import prometheus_client as p, os; print(os.path.dirname(p.__file__))"],
        capture_output=True,
        text=True,
        check=True,
    )
    borrowed = tmp_path / "prometheus"
    borrowed.mkdir()
    (borrowed / "prometheus_client").symlink_to(found.stdout.strip())
    cfg = {"backup": 1280, "load_back": 1216, "host": 304, "device": 0, "model": str(tiny_model)}
    proc = subprocess.run(
        [str(sglang_python), str(WORKERS / "sglang_metrics.py"), json.dumps(cfg)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(borrowed)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sc.hit_counters("sglang", proc.stdout) == {
        "cached_tokens_host": 304,
        "cached_tokens_device": 0,
        "load_back_tokens": 1216,
        "hicache_backup_tokens": 1280,
    }


# -- comparison, verdict, command lines ---------------------------------------------------------------


def test_the_first_mismatch_names_the_prompt_and_the_token() -> None:
    assert sc.first_mismatch([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]]) is None
    assert sc.first_mismatch([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]]) == {
        "prompt": 1,
        "token": 1,
        "a": [5, 6],
        "b": [9, 6],
    }
    assert sc.first_mismatch([[1, 2]], [[1, 2, 3]])["token"] == 2  # type: ignore[index]
    assert sc.first_mismatch([[1]], [])["prompt"] is None  # type: ignore[index]


def test_a_run_passes_only_with_the_same_tokens_and_every_required_counter_grown() -> None:
    def run(engine: str, tier: list[list[int]], hits: dict[str, float]) -> sc.RunResult:
        return sc.RunResult(engine, "/p", computed=[[1, 2], [3, 4]], from_tier=tier, hits=hits).judge()

    vllm_hits = {
        "external_prefix_cache_hits": 608.0,
        "kv_offload_load_bytes": 1.0,
        "kv_offload_store_bytes": 0.0,
    }
    assert run("vllm", [[1, 2], [3, 4]], vllm_hits).ok
    bad = run("vllm", [[1, 2], [3, 5]], vllm_hits)
    assert (
        not bad.ok
        and "tokens differ" in bad.reason
        and bad.mismatch == {"prompt": 1, "token": 1, "a": [4], "b": [5]}
    )
    cold = run("vllm", [[1, 2], [3, 4]], {**vllm_hits, "kv_offload_load_bytes": 0.0})
    assert not cold.ok and cold.reason == "no offload hits: kv_offload_load_bytes did not grow"
    sglang_hits = {"cached_tokens_host": 608.0, "load_back_tokens": 608.0, "cached_tokens_device": 0.0}
    assert run("sglang", [[1, 2], [3, 4]], sglang_hits).ok
    device_only = run("sglang", [[1, 2], [3, 4]], {"cached_tokens_device": 608.0, "load_back_tokens": 0.0})
    assert not device_only.ok and "cached_tokens_host, load_back_tokens" in device_only.reason


def test_the_verdict_gives_time_to_ready_with_and_without_the_pool_and_fails_a_run_without_result(
    tmp_path: Path,
) -> None:
    runs = {
        "vllm-pool": {"engine": "vllm", "pool": "/p", "ok": True, "ready_s": 31.5, "hits": {"a": 2.0}},
        "vllm-own": {"engine": "vllm", "pool": None, "ok": True, "ready_s": 35.25, "hits": {"a": 2.0}},
    }
    paths = []
    for name, r in runs.items():
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(r))
    lines, ok = sc.verdict_lines([sc.load_result(p) for p in paths])
    assert ok
    assert "vllm   time to ready: 35.2 s with its own host tier, 31.5 s with the pool" in lines
    lost = sc.load_result(tmp_path / "sglang-pool.json")
    assert lost["engine"] == "sglang" and not lost["ok"] and "did not finish" in lost["reason"]
    lines, ok = sc.verdict_lines([*(sc.load_result(p) for p in paths), lost])
    assert (
        not ok
        and lines[2].startswith("sglang pool ?: never ready; no metrics: FAIL (no result in")
        and "FAIL" in lines[2]
    )
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "verdict", *map(str, paths), str(tmp_path / "sglang-pool.json")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1 and "did not finish" in proc.stdout


def serve_args(*argv: str) -> argparse.Namespace:
    return sc.build_parser().parse_args(["serve", *argv])


#: what the check's vLLM command line gives the OffloadingConnector: offloadpool's spec, the pool
VLLM_EXTRA_CONFIG = {
    "spec_name": "OffloadPoolOffloadingSpec",
    "spec_module_path": "offloadpool.vllm.spec",
    "pool_dir": "/offloadpool/serve-check",
}


def test_vllm_runs_offloadpools_spec_and_keeps_the_connectors_cache(tmp_path: Path) -> None:
    args = serve_args("vllm", "--python", "/py", "--model", "/m", "--pool-dir", "/offloadpool/serve-check")
    plan = sc.engine_plan(args, 8123, tmp_path)
    assert plan.argv[:5] == ["/py", "-m", "vllm.entrypoints.cli.main", "serve", "/m"]
    kv = json.loads(plan.argv[plan.argv.index("--kv-transfer-config") + 1])
    assert kv == {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": VLLM_EXTRA_CONFIG,
    }
    assert plan.env["VLLM_SERVER_DEV_MODE"] == "1" and plan.env["VLLM_BATCH_INVARIANT"] == "1"
    assert plan.env["HF_HUB_OFFLINE"] == "1" and "OFFLOADPOOL_POOL_DIR" not in plan.env
    assert plan.env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO / "agent")
    assert plan.base == "http://127.0.0.1:8123"
    own = sc.engine_plan(
        serve_args("vllm", "--python", "/py", "--model", "/m", "--no-pool", "--tier-bytes", "4096"),
        1,
        tmp_path,
    )
    kv = json.loads(own.argv[own.argv.index("--kv-transfer-config") + 1])
    assert kv["kv_connector_extra_config"] == {"cpu_bytes_to_use": 4096}  # vLLM's CPUOffloadingSpec
    loose = serve_args("vllm", "--python", "/py", "--model", "/m", "--no-pool", "--no-deterministic")
    assert "VLLM_BATCH_INVARIANT" not in sc.engine_plan(loose, 1, tmp_path).env
    with pytest.raises(SystemExit):
        serve_args("vllm", "--python", "/py", "--model", "/m", "--no-pool", "--pool-dir", "/p")
    with pytest.raises(SystemExit):
        serve_args("vllm", "--python", "/py", "--model", "/m")


def test_sglang_gets_the_plugin_only_with_a_pool(tmp_path: Path) -> None:
    gib = 1 << 30
    args = serve_args(
        "sglang", "--python", "/py", "--model", "/m", "--pool-dir", "/pool", "--tier-bytes", str(4 * gib)
    )
    plan = sc.engine_plan(args, 8124, tmp_path)
    assert plan.argv[:3] == ["/py", "-m", "sglang.launch_server"]
    flags = plan.argv[3:]
    for flag in ("--enable-hierarchical-cache", "--enable-metrics", "--enable-deterministic-inference"):
        assert flag in flags
    assert flags[flags.index("--hicache-write-policy") + 1] == "write_through"
    assert flags[flags.index("--max-total-tokens") + 1] == "4096"
    # SGLang's GB are 1e9 bytes: half the tier, so the pool holds the host pool with room to spare
    assert int(flags[flags.index("--hicache-size") + 1]) * 10**9 <= 4 * gib // 2
    assert plan.env["OFFLOADPOOL_POOL_DIR"] == "/pool"
    plugins = Path(plan.env["PYTHONPATH"].split(os.pathsep)[-1])
    # the dist-info's entry points are the installed offloadpool's (pyproject.toml's table)
    found = [
        (ep.name, ep.value)
        for d in importlib.metadata.distributions(path=[str(plugins)])
        for ep in d.entry_points
        if ep.group == PLUGIN_GROUP
    ]
    ours = [
        (ep.name, ep.value)
        for ep in importlib.metadata.distribution("offloadpool").entry_points
        if ep.group == PLUGIN_GROUP
    ]
    assert found == ours and found
    own = sc.engine_plan(
        serve_args("sglang", "--python", "/py", "--model", "/m", "--no-pool"), 1, tmp_path / "own"
    )
    assert "OFFLOADPOOL_POOL_DIR" not in own.env
    assert not (tmp_path / "own" / "plugins").exists()


# -- the whole client against a stand-in server ---------------------------------------------------------


def fake_python(tmp_path: Path) -> Path:
    py = tmp_path / "python"
    py.write_text(f'#!/bin/sh\nexec {sys.executable} {WORKERS / "fake_engine.py"} "$@"\n')
    py.chmod(0o755)
    return py


def fake_model(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"vocab_size": 501, "bos_token_id": 0, "eos_token_id": 1}))
    return d


def run_serve(
    tmp_path: Path, engine: str, *extra: str, env: dict[str, str] | None = None
) -> tuple[int, dict[str, Any]]:
    out = tmp_path / f"{engine}.json"
    pidfile = tmp_path / "pid"
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "serve",
            engine,
            "--python",
            str(fake_python(tmp_path)),
            "--model",
            str(fake_model(tmp_path)),
            "--json",
            str(out),
            "--metrics-wait",
            "0",
            *extra,
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "FAKE_SERVE_PIDFILE": str(pidfile), **(env or {})},
    )
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout) == result
    pid = int(pidfile.read_text())
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    return proc.returncode, result


@pytest.mark.parametrize("engine", sc.ENGINES)
@pytest.mark.parametrize("tier", [["--pool-dir", "/nowhere"], ["--no-pool"]])
def test_the_client_serves_evicts_compares_and_stops_the_server(
    tmp_path: Path, engine: str, tier: list[str]
) -> None:
    rc, r = run_serve(tmp_path, engine, *tier, "--device-tokens", "1024")
    assert rc == 0 and r["ok"], r["reason"]
    assert r["engine"] == engine and r["pool"] == ("/nowhere" if "--pool-dir" in tier else None)
    assert r["ready_s"] is not None and r["ready_s"] >= 0.5  # /health answered 503 at first
    assert len(r["computed"]) == 4 and r["computed"] == r["from_tier"]
    assert r["cached_tokens"] == [320, 320, 320, 320]  # every prompt from the host tier, whole blocks
    if engine == "vllm":
        assert r["evict"] == "POST /reset_prefix_cache: success after 2 call(s)"
        assert r["hits"]["external_prefix_cache_hits"] == 4 * 320
    else:
        assert r["evict"].startswith("5 filler prompts of 320 tokens through a 1024-token device cache")
        assert r["hits"]["cached_tokens_host"] == r["hits"]["load_back_tokens"] == 4 * 320
        assert r["hits"]["cached_tokens_device"] == 0


@pytest.mark.parametrize("engine", sc.ENGINES)
def test_the_client_fails_a_run_whose_tokens_differ_or_that_had_no_hits(tmp_path: Path, engine: str) -> None:
    (tmp_path / "a").mkdir()
    rc, r = run_serve(tmp_path / "a", engine, "--no-pool", env={"FAKE_SERVE_MISMATCH": "1"})
    assert rc == 1 and not r["ok"] and r["mismatch"]["prompt"] == 0 and r["mismatch"]["token"] == 0
    (tmp_path / "b").mkdir()
    rc, r = run_serve(tmp_path / "b", engine, "--no-pool", "--timeout", "4", env={"FAKE_SERVE_NO_HITS": "1"})
    assert rc == 1 and not r["ok"]
    if engine == "vllm":
        assert "no offload hits" in r["reason"] and r["computed"] == r["from_tier"]
    else:  # nothing was backed up to the host, so the eviction never starts: bounded by --timeout
        assert "backed up fewer than 1280 tokens" in r["reason"]


def test_a_server_that_never_gets_ready_is_stopped_at_the_deadline(tmp_path: Path) -> None:
    started = time.monotonic()
    rc, r = run_serve(tmp_path, "vllm", "--no-pool", "--ready-timeout", "0.3")
    assert rc == 1 and r["reason"] == "RuntimeError: the server was not ready before the deadline"
    assert r["ready_s"] is None and time.monotonic() - started < 60


# -- no GPU -------------------------------------------------------------------------------------------------


def test_the_gpu_check_says_plainly_that_no_serving_check_ran_without_a_gpu(tmp_path: Path) -> None:
    # an nvidia-smi that fails as it does on a machine without a GPU, first on PATH, so the test
    # means the same on a machine that has one
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    proc = subprocess.run(
        ["bash", str(REPO / "hack" / "gpu-check.sh")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT_DIR": str(tmp_path / "out")},
    )
    assert proc.returncode == 1
    assert "no GPU: the end-to-end serving checks (vLLM, SGLang) did not run" in proc.stderr
    assert not list((tmp_path / "out").iterdir())  # nothing ran


# -- the engines' own argument parsers accept the command lines ------------------------------------


def parse_with(python: Path, engine: str, argv: list[str]) -> dict[str, Any]:
    proc = subprocess.run(
        [str(python), str(WORKERS / "engine_args.py"), engine, json.dumps(argv)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # a flag the engine has renamed is still parsed, with a warning naming it
    assert not re.search(r"--[a-z][a-z-]*'? (is|are) deprecated", proc.stderr), proc.stderr[-2000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_vllm_serve_parses_the_command_line(vllm_python: Path, tmp_path: Path) -> None:
    args = serve_args("vllm", "--python", "/py", "--model", "/m", "--pool-dir", "/offloadpool/serve-check")
    argv = sc.engine_plan(args, 8000, tmp_path).argv
    assert argv[2:4] == ["vllm.entrypoints.cli.main", "serve"]
    parsed = parse_with(vllm_python, "vllm", argv[4:])
    assert parsed == {
        "model": "/m",
        "served_model_name": ["tiny"],
        "enforce_eager": True,
        "enable_prompt_tokens_details": True,
        "block_size": 16,
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": VLLM_EXTRA_CONFIG,
    }


def test_sglang_launch_server_parses_the_command_line(sglang_python: Path, tmp_path: Path) -> None:
    args = serve_args(
        "sglang", "--python", "/py", "--model", "/m", "--pool-dir", "/p", "--tier-bytes", str(4 << 30)
    )
    argv = sc.engine_plan(args, 8000, tmp_path).argv
    assert argv[2] == "sglang.launch_server"
    assert parse_with(sglang_python, "sglang", argv[3:]) == {
        "model_path": "/m",
        "enable_hierarchical_cache": True,
        "hicache_write_policy": "write_through",
        "hicache_size": 2,
        "attention_backend": "fa3",
        "enable_deterministic_inference": True,
        "max_total_tokens": 4096,
        "enable_metrics": True,
        "cuda_graph_backend_decode": "disabled",
        "cuda_graph_backend_prefill": "disabled",
    }
