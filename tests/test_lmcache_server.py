"""LMCache's own server with a pool segment as its L1 (docs/lmcache.md), on CPU.

A real pool (one segment file, ``max_files=1``) provisioned by the node engine; the lease held by
``offloadpool hold-lease`` as the webhook's sidecar holds it in a pod; the pinned ``lmcache
server`` (hack/vllm_env.py --engine lmcache) started with ``--l1-devdax-path <pool>/mnt/r0-s000``; LMCache's
own server-bench client stores KV chunks and reads them back. The bytes must be in the pool's
file, read by this (another) process through the file, and the node's holder scan must see the
server mapping the pool and the sidecar holding its lease.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from fixtures.vllm_env import LMCACHE_WORKERS as WORKERS
from fixtures.wait import wait_for
from offloadpool.region.files import manifest
from offloadpool.region.holding.holders import find_holders

MiB = 1 << 20
POOL_BYTES = 64 * MiB
SHAPE = "(2,64,16,2,64):float16:2"  # 2 layers, K/V, 64 blocks of 16 tokens, 2 heads x 64
QUIET = {"LMCACHE_DISABLE_BANNER": "1", "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get_json(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return json.loads(resp.read())
    except OSError:
        return None


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def server_command(lmcache_python: Path, segment: Path, size_gb: float, port: int, http: int) -> list[str]:
    """``lmcache server`` with the segment as its whole L1, as examples/lmcache-server.yaml runs it."""
    return [
        str(lmcache_python.parent / "lmcache"),
        "server",
        "--l1-devdax-path",
        str(segment),
        "--l1-size-gb",
        repr(size_gb),
        "--no-l1-use-lazy",
        "--shm-name",
        "",
        "--eviction-policy",
        "LRU",
        "--disable-metrics",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--http-host",
        "127.0.0.1",
        "--http-port",
        str(http),
    ]


@pytest.fixture
def held_pool(make_pool, tmp_path: Path) -> Iterator[tuple[Path, Path, subprocess.Popen]]:
    """A one-file pool, its segment, and the lease sidecar holding it."""
    pool_dir = make_pool("lmc", POOL_BYTES, max_files=1)
    segments = [s for r in manifest.load(pool_dir).regions for s in r.segments]
    assert [(s.file, s.bytes) for s in segments] == [("mnt/r0-s000", POOL_BYTES)]
    ready = tmp_path / "lease-held"
    sidecar = subprocess.Popen(
        [str(Path(sys.executable).parent / "offloadpool"), "hold-lease", str(pool_dir)]
        + ["--ready-file", str(ready)]
    )
    try:
        wait_for("the lease sidecar holds the lease", ready.exists, timeout=30)
        yield pool_dir, pool_dir / segments[0].file, sidecar
    finally:
        stop(sidecar)


def test_lmcache_server_stores_and_reads_back_in_the_pools_segment(
    held_pool: tuple[Path, Path, subprocess.Popen], lmcache_python: Path, tmp_path: Path
) -> None:
    pool_dir, segment, sidecar = held_pool
    port, http = free_port(), free_port()
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(
        server_command(lmcache_python, segment, POOL_BYTES / (1 << 30), port, http),
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **QUIET},
    )
    try:
        status = wait_for(
            "lmcache server's L1 arena",
            lambda: (
                server.poll() is None
                and get_json(f"http://127.0.0.1:{http}/reconfigure/dax/l1/status")
                or (server.poll() is not None and {"exited": server.returncode})
            ),
            timeout=180,
        )
        assert status.get("exited") is None, (tmp_path / "server.log").read_text()[-4000:]
        assert [(a["device_path"], a["size_in_bytes"], a["state"]) for a in status["arenas"]] == [
            (str(segment), POOL_BYTES, "active")
        ]
        # the server maps the pool's file itself (shared), and the node sees it with the sidecar
        maps = Path(f"/proc/{server.pid}/maps").read_text()
        assert any(line.split()[1] == "rw-s" and line.endswith(str(segment)) for line in maps.splitlines())
        holders = {h.pid: h for h in find_holders(pool_dir)}
        assert holders[server.pid].mapped and not holders[server.pid].lease
        assert holders[sidecar.pid].lease

        fill = 7001
        out = subprocess.run(
            [
                str(lmcache_python),
                str(WORKERS / "roundtrip.py"),
                json.dumps(
                    {
                        "rpc_url": f"tcp://127.0.0.1:{port}",
                        "http_url": f"http://127.0.0.1:{http}",
                        "shape": SHAPE,
                        "num_tokens": 511,
                        "fill": fill,
                    }
                ),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, **QUIET},
        )
        assert out.returncode == 0, out.stderr[-4000:]
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert (result["hits_before"], result["hits_after"], result["chunks"]) == (0, 2, 2), result
        assert result["stored"] and result["retrieved"] and result["equal"], result

        # the stored bytes are in the pool's file, read through the file by this process
        sample = bytes.fromhex(result["sample_hex"])
        data = segment.read_bytes()
        assert len(data) == POOL_BYTES
        assert data.find(sample[:256]) >= 0, "the first token's K of layer 0 is not in the pool's file"
        assert data.find(sample) >= 0, "block 0's K of layer 0 is not in the pool's file"
        assert (
            sum(1 for i in range(0, POOL_BYTES, 4096) if data[i : i + 4096].strip(b"\0")) * 4096
            >= (result["stored_bytes"])
        )
        arenas = get_json(f"http://127.0.0.1:{http}/reconfigure/dax/l1/status")
        assert arenas is not None and arenas["arenas"][0]["used_bytes"] >= result["stored_bytes"]
    finally:
        stop(server)
        log.close()
    # the server gone, only the sidecar holds the pool; the bytes stay in the pool's memory
    assert [h.pid for h in find_holders(pool_dir)] == [sidecar.pid]
    assert segment.read_bytes().find(bytes.fromhex(result["sample_hex"])) >= 0


def test_lmcache_server_refuses_an_l1_larger_than_the_segment(
    held_pool: tuple[Path, Path, subprocess.Popen], lmcache_python: Path, tmp_path: Path
) -> None:
    """LMCache checks the file's size before it maps: an L1 asked larger than the pool's segment
    stops the server at start with both numbers (docs/lmcache.md, "What fails how")."""
    pool_dir, segment, _ = held_pool
    started = time.monotonic()
    out = subprocess.run(
        server_command(lmcache_python, segment, 2 * POOL_BYTES / (1 << 30), free_port(), free_port()),
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **QUIET},
    )
    text = out.stdout + out.stderr
    refusal = f"l1 devdax size ({2 * POOL_BYTES} bytes) exceeds {segment} capacity ({POOL_BYTES} bytes)"
    assert refusal in text, text[-4000:]
    assert out.returncode != 0 or "Application startup failed" in text, text[-4000:]
    assert time.monotonic() - started < 180
    assert segment.stat().st_size == POOL_BYTES  # never truncated
