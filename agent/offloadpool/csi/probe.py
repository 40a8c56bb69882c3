"""The DaemonSet's liveness probe: ``python3 -m offloadpool.csi probe`` calls the plugin's
``Probe`` over its CSI socket, as the kubelet would, and exits 0 only when it answers ready.

An exec probe, not the kubelet's gRPC probe nor the livenessprobe sidecar: the kubelet's gRPC
probe dials a TCP port and asks the gRPC health service, while the plugin serves CSI on a unix
socket only (no port opened in a privileged pod) and what must be alive is that socket's CSI
service, the very one the kubelet publishes through; the livenessprobe sidecar answers the
same question but is a Go binary to build and ship in a second container. A wedged plugin
(its servers' threads stuck, its socket gone) fails here and the kubelet restarts it; the
restarted plugin rebuilds its holders first (``publication.rebuild``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import grpc

from offloadpool.csi.config import CsiConfig
from offloadpool.csi.proto import csi_pb2, csi_pb2_grpc

#: seconds the probe waits for the answer (the pod's probe has its own timeoutSeconds above it)
TIMEOUT = 5.0


def probe(endpoint: str, timeout: float = TIMEOUT) -> str | None:
    """None when the plugin at ``endpoint`` answers ``Probe`` ready, else why not."""
    with grpc.insecure_channel(f"unix://{endpoint}") as channel:
        try:
            answer = csi_pb2_grpc.IdentityStub(channel).Probe(csi_pb2.ProbeRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            return f"Probe on {endpoint} failed: {exc.code().name}: {exc.details()}"
    # an unset ``ready`` means ready (the CSI spec: the plugin is ready if it answers at all)
    if answer.HasField("ready") and not answer.ready.value:
        return f"the plugin at {endpoint} answers not ready"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    config = CsiConfig.from_args(argv)
    why = probe(config.endpoint)
    if why is not None:
        print(why, file=sys.stderr)
        return 1
    print(f"{config.endpoint}: ready")
    return 0
