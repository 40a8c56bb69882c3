"""The kubelet's ``dra.v1`` ``DRAPlugin`` service: each claim of a request prepared (or
unprepared) on its own, its error in its own answer (the kubelet retries the claims that
failed)."""

from __future__ import annotations

import logging
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from offloadpool.csi.refusal import Refused
from offloadpool.dra import claims, prepare
from offloadpool.dra.config import DraConfig
from offloadpool.dra.proto import dra_pb2, dra_pb2_grpc
from offloadpool.region.errors import RegionError

log = logging.getLogger(__name__)


class DraPlugin(dra_pb2_grpc.DRAPluginServicer):
    def __init__(self, config: DraConfig, api: client.ApiClient) -> None:
        self.config = config
        self.api = api

    def NodePrepareResources(self, request: Any, context: Any) -> Any:
        out = dra_pb2.NodePrepareResourcesResponse()
        for c in request.claims:
            answer = out.claims[c.uid]
            try:
                claim = claims.read(self.api, c.namespace, c.name, c.uid)
                for device in claims.allocated(claim, self.config.node_id):
                    cdi = prepare.prepare(self.config, c.namespace, c.name, c.uid, device)
                    answer.devices.add(
                        request_names=[device.request],
                        pool_name=device.dra_pool,
                        device_name=device.device,
                        cdi_device_ids=[cdi],
                    )
            except Exception as exc:  # each claim answers for itself
                del answer.devices[:]
                answer.error = _say(exc)
                log.warning("prepare of claim %s/%s (%s): %s", c.namespace, c.name, c.uid, answer.error)
        return out

    def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
        out = dra_pb2.NodeUnprepareResourcesResponse()
        for c in request.claims:
            answer = out.claims[c.uid]
            try:
                if not claims.CLAIM_UID_PATTERN.fullmatch(c.uid):
                    raise claims.ClaimError(f"claim uid {c.uid!r} is not a uid")
                prepare.unprepare(self.config, c.uid)
            except Exception as exc:
                answer.error = _say(exc)
                log.warning("unprepare of claim %s/%s (%s): %s", c.namespace, c.name, c.uid, answer.error)
        return out


def _say(exc: Exception) -> str:
    if isinstance(exc, Refused):
        return f"{exc.code.name}: {exc.message}"
    if isinstance(exc, ApiException):
        return f"reading the claim: {exc.status} {exc.reason}"
    if isinstance(exc, (claims.ClaimError, RegionError)):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
