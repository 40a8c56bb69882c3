#!/usr/bin/env python3
"""What one agent heartbeat (a Lease renewal) costs the machine, against a real control plane.

Every Ready agent renews its Lease once per ``--agent-heartbeat`` (the agents' default), for as long
as it runs: at N nodes that is N / heartbeat writes a second, the steady state's only writes and,
while a big pool converges, a cost that grows with the nodes already Ready times the seconds the
rest take. This renews ``--leases`` Leases through the agent's own code (``KubeAccess.
renew_heartbeat``: a merge patch of ``renewTime``), authenticated as the agents are (a bound
ServiceAccount token), and measures the CPU it costs each process — the API server, etcd, the
controller manager (its garbage collector watches every Lease) and the client — per renewal,
median of ``--rounds`` rounds after one warm-up round. Then what N nodes cost at a few
heartbeats, in cores of this machine.

    .venv/bin/python bench/heartbeat_cost.py [--leases 100] [--renewals 1000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the package `hack`

NAMESPACE = "default"
SERVICE_ACCOUNT = "bench-agent"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--leases", type=int, default=100, help="Leases renewed in turn (one per agent)")
    p.add_argument("--renewals", type=int, default=1000, help="renewals per round")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()

    from kubernetes import client, config

    from hack.controlplane import ControlPlane
    from hack.controlplane_build import ensure_built
    from offloadpool.agent import kube

    plane = ControlPlane(ensure_built(), Path(tempfile.mkdtemp()) / "cp")
    plane.start()
    try:
        admin = config.new_client_from_config(str(plane.kubeconfig))
        core, rbac = client.CoreV1Api(admin), client.RbacAuthorizationV1Api(admin)
        core.create_namespaced_service_account(NAMESPACE, {"metadata": {"name": SERVICE_ACCOUNT}})
        rbac.create_namespaced_role(
            NAMESPACE,
            {
                "metadata": {"name": SERVICE_ACCOUNT},
                "rules": [
                    {
                        "apiGroups": ["coordination.k8s.io"],
                        "resources": ["leases"],
                        "verbs": ["get", "create", "patch"],
                    }
                ],
            },
        )
        rbac.create_namespaced_role_binding(
            NAMESPACE,
            {
                "metadata": {"name": SERVICE_ACCOUNT},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": SERVICE_ACCOUNT},
                "subjects": [{"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": NAMESPACE}],
            },
        )
        token = core.create_namespaced_service_account_token(
            SERVICE_ACCOUNT, NAMESPACE, {"spec": {"audiences": [], "expirationSeconds": 3600}}
        ).status.token
        cfg = client.Configuration()
        cfg.host = plane.server
        cfg.ssl_ca_cert = str(plane.pki.ca_crt)
        cfg.api_key = {"authorization": token}
        cfg.api_key_prefix = {"authorization": "Bearer"}
        agent_api = client.ApiClient(cfg)
        pool = {"metadata": {"name": "bench"}}  # no uid: no owner, so the garbage collector keeps them
        agents = [
            kube.KubeAccess(agent_api, "bench", f"bench.node-{i:04d}", NAMESPACE) for i in range(args.leases)
        ]
        for agent in agents:  # the first renewal of each makes its Lease
            agent.renew_heartbeat(40, pool)

        per_process: dict[str, list[float]] = {}
        for rnd in range(args.rounds + 1):
            before, c0 = plane.cpu_seconds(), time.process_time()
            for k in range(args.renewals):
                agents[k % len(agents)].renew_heartbeat(40, pool)
            spent = {name: value - before.get(name, 0.0) for name, value in plane.cpu_seconds().items()}
            spent["client (the agent's code)"] = time.process_time() - c0
            if rnd:  # round 0 warms connections, caches and the watch caches
                for name, seconds in spent.items():
                    per_process.setdefault(name, []).append(1000 * seconds / args.renewals)
    finally:
        plane.stop()

    medians = {name: statistics.median(values) for name, values in per_process.items()}
    total = sum(medians.values())
    print(
        f"CPU-ms per Lease renewal ({args.leases} Leases, median of {args.rounds} rounds × "
        f"{args.renewals} renewals)\n"
    )
    print("| process | CPU-ms / renewal | share |")
    print("|---|---:|---:|")
    for name, ms in sorted(medians.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {ms:.2f} | {100 * ms / total:.0f} % |")
    print(f"| **all** | **{total:.2f}** | |")
    print("\nSteady heartbeats, in cores of this machine (renewals/s × CPU per renewal):\n")
    heartbeats = (10, 20, 30)
    print("| nodes | " + " | ".join(f"heartbeat {h} s" for h in heartbeats) + " |")
    print("|---:|" + "---:|" * len(heartbeats))
    for nodes in (1000, 5000):
        cells = [f"{nodes / h:.0f}/s: {nodes / h * total / 1000:.2f}" for h in heartbeats]
        print(f"| {nodes} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
