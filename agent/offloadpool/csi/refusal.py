"""A request the plugin refuses, with the gRPC status code the CSI spec gives the case."""

from __future__ import annotations

import grpc


class Refused(Exception):
    """Raised before anything is touched (or after what was touched is undone)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> Refused:
    return Refused(grpc.StatusCode.INVALID_ARGUMENT, message)
