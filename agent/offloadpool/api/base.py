"""Shared pydantic plumbing: camelCase aliases, quantity and timestamp field types.

Every model reads and writes the API's camelCase names (``by_alias=True``) while Python code
uses snake_case attributes (``populate_by_name``). Spec models forbid unknown fields (a typo in
a spec must fail, as the API server's strict field validation does); status and object models
keep unknown fields so a newer operator's status survives a round trip through an older agent.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, PlainSerializer
from pydantic.alias_generators import to_camel

from .quantity import QuantityError, parse_quantity


class SpecModel(BaseModel):
    """Base of user-written spec models: unknown fields are errors."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", validate_assignment=True
    )


class StatusModel(BaseModel):
    """Base of status and object models: unknown fields are kept, not lost."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="allow", validate_assignment=True
    )


def _check_quantity(value: Any) -> int | str:
    """Keep the user's spelling (``64Gi`` stays ``64Gi``) but insist it is whole bytes > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{value!r} is not a quantity (expected an integer or a string like 64Gi)")
    try:
        n = parse_quantity(value)
    except QuantityError as exc:
        raise ValueError(f"{exc}; must be a positive whole number of bytes, for example 64Gi") from None
    if n <= 0:
        raise ValueError(f"{value!r} must be a positive whole number of bytes, for example 64Gi")
    return value


#: A positive, whole-byte Kubernetes quantity, stored as written (int or string).
Quantity = Annotated[int | str, BeforeValidator(_check_quantity)]


def format_time(value: datetime) -> str:
    """RFC 3339 in UTC with a ``Z``, as Kubernetes writes times; fractions only when present."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    value = value.astimezone(timezone.utc)
    text = value.strftime("%Y-%m-%dT%H:%M:%S")
    if value.microsecond:
        text += f".{value.microsecond:06d}".rstrip("0")
    return text + "Z"


def now() -> datetime:
    """The current time in UTC, for heartbeats and condition transitions."""
    return datetime.now(timezone.utc)


#: A date-time field that serialises the way the API server stores it.
Timestamp = Annotated[datetime, PlainSerializer(format_time, return_type=str)]
