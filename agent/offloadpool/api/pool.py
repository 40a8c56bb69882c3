"""OffloadPool: the whole object (apiVersion, kind, metadata, spec, status)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from .base import StatusModel
from .constants import API_VERSION, POOL_KIND, pool_name_error
from .spec import OffloadPoolSpec
from .status import OffloadPoolStatus


class OffloadPool(StatusModel):
    """An OffloadPool as the API server returns it.

    ``OffloadPool.model_validate(obj).model_dump(by_alias=True, exclude_none=True)`` gives back
    ``obj`` unchanged (metadata is kept as a plain dict: its shape is Kubernetes', not ours).
    """

    api_version: str = API_VERSION
    kind: str = POOL_KIND
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: OffloadPoolSpec
    status: OffloadPoolStatus | None = None

    @field_validator("metadata")
    @classmethod
    def _name(cls, value: dict[str, Any]) -> dict[str, Any]:
        name = value.get("name")
        if name is not None:
            error = pool_name_error(str(name))
            if error:
                raise ValueError(error)
        return value

    @property
    def name(self) -> str:
        return str(self.metadata.get("name", ""))

    @property
    def generation(self) -> int:
        return int(self.metadata.get("generation", 0))
