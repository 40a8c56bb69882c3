#!/usr/bin/env python3
"""What one API write costs the operator's process, four ways, against a real API server.

The operator's cost per node to converge is dominated by its two writes per node (create the
OffloadPoolNode, mark the Node). This measures the client-side CPU of one such write (a merge
patch of a Node's status, the answer read) through:

- ``generated``: the kubernetes client's generated method (``CoreV1Api.patch_node_status``,
  answer as raw JSON) — what the operator used before;
- ``rest``: the client's own REST layer with the auth headers reused — what the operator used
  for its per-node writes until ``Kube.send`` went straight to the pool;
- ``urllib3``: ``Kube.send`` — the client's own urllib3 connection pool for the API server,
  called directly: same connections, TLS and auth as ``rest``, without the REST layer's and the
  pool manager's per-request work (what the operator uses now);
- ``http.client``: the standard library on one kept-alive TLS connection — the floor for
  Python, no pool, no retries, shown for scale only.

Process CPU (``time.process_time``) per write, median of ``--rounds`` rounds of ``--writes``
writes each, after one warm-up round; ratios to ``http.client``. Starts its own control plane
(hack.controlplane, built and cached by the test command).

    .venv/bin/python bench/api_write.py [--writes 300] [--rounds 5]
"""

from __future__ import annotations

import argparse
import http.client
import json
import ssl
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the package `hack`

MERGE = "application/merge-patch+json"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--writes", type=int, default=300)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()

    from kubernetes import client, config

    from hack.controlplane import ControlPlane
    from hack.controlplane_build import ensure_built
    from offloadpool.operator.kube import Kube

    plane = ControlPlane(ensure_built(), Path(tempfile.mkdtemp()) / "cp")
    plane.start()
    try:
        api = config.new_client_from_config(str(plane.kubeconfig))
        core = client.CoreV1Api(api)
        names = [f"bench-write-{i}" for i in range(args.writes)]
        for name in names:
            core.create_node({"metadata": {"name": name}}, _preload_content=False).release_conn()
        kube = Kube(api)
        cfg = api.configuration
        ctx = ssl.create_default_context(cafile=cfg.ssl_ca_cert)
        if cfg.cert_file:
            ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
        conn = http.client.HTTPSConnection(cfg.host.split("//", 1)[1], context=ctx)
        auth = kube._auth_headers()

        def generated(name: str, value: str) -> None:
            resp = core.patch_node_status(
                name, {"metadata": {"labels": {"b": value}}}, _preload_content=False, _content_type=MERGE
            )
            json.loads(resp.read())
            resp.release_conn()

        def rest(name: str, value: str) -> None:
            resp = api.rest_client.request(
                "PATCH",
                f"{cfg.host}/api/v1/nodes/{name}/status",
                headers={"Accept": "application/json", "Content-Type": MERGE, **auth},
                body={"metadata": {"labels": {"b": value}}},
            )
            json.loads(resp.read())

        def urllib3_pool(name: str, value: str) -> None:
            kube.send("PATCH", f"/api/v1/nodes/{name}/status", {"metadata": {"labels": {"b": value}}})

        def plain(name: str, value: str) -> None:
            body = json.dumps({"metadata": {"labels": {"b": value}}})
            conn.request(
                "PATCH",
                f"/api/v1/nodes/{name}/status",
                body=body,
                headers={"Content-Type": MERGE, "Accept": "application/json", **auth},
            )
            json.loads(conn.getresponse().read())

        ways: dict[str, Callable[[str, str], None]] = {
            "generated": generated,
            "rest": rest,
            "urllib3": urllib3_pool,
            "http.client": plain,
        }
        samples: dict[str, list[float]] = {way: [] for way in ways}
        for rnd in range(args.rounds + 1):
            for way, write in ways.items():
                c0 = time.process_time()
                for name in names:
                    write(name, f"{way.replace('.', '-')}-{rnd}")
                if rnd:  # round 0 warms connections and caches
                    samples[way].append(1000 * (time.process_time() - c0) / len(names))
        floor = statistics.median(samples["http.client"])
        print(f"client CPU per write (median of {args.rounds} rounds × {args.writes} writes)\n")
        print("| way | CPU-ms / write | × http.client |")
        print("|---|---:|---:|")
        for way, values in samples.items():
            med = statistics.median(values)
            print(f"| {way} | {med:.3f} | {med / floor:.2f} |")
        for name in names:
            core.delete_node(name, _preload_content=False).release_conn()
    finally:
        plane.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
