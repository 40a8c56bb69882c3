"""A stand-in for ``vllm serve`` / SGLang's server, for the serving check's plumbing only.

    fake_engine.py -m vllm.entrypoints.cli.main serve MODEL ... --port P ...
    fake_engine.py -m sglang.launch_server --model-path MODEL ... --port P ...

It answers the endpoints hack/serve_check.py uses -- /health, /v1/completions or /generate,
/reset_prefix_cache, /metrics -- with the engines' request and response shapes, keeps a device
and a host tier of whole prompts the way the real ones keep blocks (vLLM: the device cache is
emptied by /reset_prefix_cache, which fails once as it does while stores are in flight; SGLang: a
write-through host and an LRU device cache of --max-total-tokens tokens), and publishes the hit
counters under the names and labels the pinned engines use (their exposition, from
tests/serve_workers/{vllm,sglang}_metrics.py). It decodes nothing: a prompt's "tokens" are a
function of its ids. Nothing here says anything about an engine; tests/test_serve_check.py uses
it to run serve_check.py's client, eviction, comparison, timeouts and shutdown end to end.

FAKE_SERVE_MISMATCH=1 alters the first token of a prompt that comes back from the host tier;
FAKE_SERVE_NO_HITS=1 keeps the host tier empty; FAKE_SERVE_PIDFILE names a file for its pid.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ARGV = sys.argv[1:]
ENGINE = "vllm" if "vllm.entrypoints.cli.main" in ARGV else "sglang"
PORT = int(ARGV[ARGV.index("--port") + 1])
DEVICE_TOKENS = int(ARGV[ARGV.index("--max-total-tokens") + 1]) if "--max-total-tokens" in ARGV else 1 << 30
MISMATCH = os.environ.get("FAKE_SERVE_MISMATCH") == "1"
NO_HITS = os.environ.get("FAKE_SERVE_NO_HITS") == "1"
KV_BYTES_PER_TOKEN = 1024
STARTED = time.monotonic()

device: OrderedDict[tuple[int, ...], None] = OrderedDict()
host: set[tuple[int, ...]] = set()
counters = {
    "ext_queries": 0,
    "ext_hits": 0,
    "load": 0,
    "store": 0,
    "host": 0,
    "device": 0,
    "backup": 0,
    "back": 0,
}
resets = {"calls": 0}


def decode(ids: list[int], n: int) -> list[int]:
    return [(sum(ids) * 7 + i * 13) % 500 + 2 for i in range(n)]


def serve_prompt(ids: list[int], n: int) -> tuple[list[int], int, dict[str, int]]:
    key = tuple(ids)
    blocks = len(ids) // 16 * 16
    out = decode(ids, n)
    source = {"device": 0, "host": 0}
    if key in device:
        device.move_to_end(key)
        source["device"] = blocks
    elif key in host:
        source["host"] = blocks
        if MISMATCH:
            out[0] += 1
    if ENGINE == "vllm":
        counters["ext_queries"] += len(ids) - source["device"]
        counters["ext_hits"] += source["host"]
        counters["load"] += source["host"] * KV_BYTES_PER_TOKEN
        if key not in host and not NO_HITS:
            host.add(key)
            counters["store"] += blocks * KV_BYTES_PER_TOKEN
    else:
        counters["host"] += source["host"]
        counters["device"] += source["device"]
        counters["back"] += source["host"]
        if key not in host and not NO_HITS:
            host.add(key)
            counters["backup"] += len(ids)
    device[key] = None
    while sum(map(len, device)) > DEVICE_TOKENS:
        device.popitem(last=False)
    return out, source["device"] + source["host"], source


def metrics() -> str:
    if ENGINE == "vllm":
        lab = 'engine="0",model_name="tiny"'
        return "".join(
            [
                "# HELP vllm:external_prefix_cache_queries_total External prefix cache queries\n",
                "# TYPE vllm:external_prefix_cache_queries_total counter\n",
                f"vllm:external_prefix_cache_queries_total{{{lab}}} {float(counters['ext_queries'])}\n",
                f"vllm:external_prefix_cache_hits_total{{{lab}}} {float(counters['ext_hits'])}\n",
                f"vllm:external_prefix_cache_hits_created{{{lab}}} 1.7964286446321924e+09\n",
                f"vllm:kv_offload_load_bytes_total{{{lab}}} {float(counters['load'])}\n",
                f"vllm:kv_offload_store_bytes_total{{{lab}}} {float(counters['store'])}\n",
                f'vllm:kv_offload_total_bytes_total{{{lab},transfer_type="CPU_to_GPU"}} '
                f"{float(counters['load'])}\n",
            ]
        )
    rank = 'cache_type="UnifiedRadixCache",dp_rank="0",pool="kv",pp_rank="0",tp_rank="0"'
    lines = [
        f"sglang:load_back_tokens_total{{{rank}}} {float(counters['back'])}\n",
        f"sglang:hicache_backup_tokens_total{{{rank}}} {float(counters['backup'])}\n",
    ]
    for source in ("host", "device"):
        if counters[source]:
            lines.append(
                f'sglang:cached_tokens_total{{cache_source="{source}",model_name="tiny"}} '
                f"{float(counters[source])}\n"
            )
    return "".join(lines)


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def reply(self, code: int, body: object, content_type: str = "application/json") -> None:
        data = (body if isinstance(body, str) else json.dumps(body)).encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            self.reply(200 if time.monotonic() - STARTED > 0.5 else 503, {})
        elif self.path == "/metrics":
            self.reply(200, metrics(), "text/plain")
        else:
            self.reply(404, {"error": self.path})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        if ENGINE == "vllm" and self.path == "/v1/completions":
            out, cached, _ = serve_prompt(body["prompt"], body["max_tokens"])
            usage = {"prompt_tokens": len(body["prompt"]), "prompt_tokens_details": {"cached_tokens": cached}}
            self.reply(200, {"choices": [{"index": 0, "token_ids": out, "text": ""}], "usage": usage})
        elif ENGINE == "vllm" and self.path.startswith("/reset_prefix_cache"):
            resets["calls"] += 1
            ok = resets["calls"] > 1 and "reset_external" not in self.path
            if ok:
                device.clear()
            self.reply(200, {"success": ok})
        elif ENGINE == "sglang" and self.path == "/generate":
            sp = body["sampling_params"]
            out, cached, source = serve_prompt(body["input_ids"], sp["max_new_tokens"])
            meta = {"cached_tokens": cached, "cached_tokens_details": source}
            self.reply(200, {"text": "", "output_ids": out, "meta_info": meta})
        else:
            self.reply(404, {"error": self.path})


def main() -> None:
    pidfile = os.environ.get("FAKE_SERVE_PIDFILE")
    if pidfile:
        with open(pidfile, "w") as f:
            f.write(str(os.getpid()))
    ThreadingHTTPServer(("127.0.0.1", PORT), Handler).serve_forever()


if __name__ == "__main__":
    main()
