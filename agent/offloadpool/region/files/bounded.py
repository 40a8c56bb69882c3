"""The one reader of JSON the node did not write alone: bounded before anything is decoded.

Whatever a pod can write (the manifest, a share's claim record, a record an older release left
in the pool directory) may hold any bytes: a number of 5,000 digits (``int`` refuses more than
4,300: a ``ValueError`` that is not a decode error), nesting deep enough to exhaust the
decoder's recursion (``RecursionError``), ``NaN``, a megabyte of anything. ``loads`` refuses
each of them as ``Malformed`` (a ``ValueError``) before it is decoded, or while it is: the size
(``limit``), the nesting depth (``MAX_DEPTH``), the length of every number (``MAX_NUMBER``),
no ``NaN``/``Infinity``. The caller then checks the types of what it uses; a malformed entry is
reported and rebuilt by its owner, never an exception of another kind.

The node's own root-only files (the provisioning record, the csi publications) go through
the same reader: one parser, one set of bounds.
"""

from __future__ import annotations

import json
import re
from typing import Any

from offloadpool.region.files import beneath

#: the deepest nesting of arrays and objects read (the manifest needs 4, the record 3)
MAX_DEPTH = 16
#: the most characters of one number (a 64-bit integer has 20, a float's repr at most 24)
MAX_NUMBER = 32

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(rb"[\[\]{}]")


class Malformed(ValueError):
    """The bytes are not bounded JSON: too long, too deep, a number too long, not JSON."""


def _depth_error(data: bytes) -> str | None:
    depth = 0
    for m in _BRACKET.finditer(_STRING.sub(b'""', data)):
        depth += 1 if m.group() in (b"[", b"{") else -1
        if depth > MAX_DEPTH:
            return f"nests deeper than {MAX_DEPTH} levels"
    return None


def _number(text: str) -> str:
    if len(text) > MAX_NUMBER:
        raise Malformed(f"holds a number of {len(text)} characters (at most {MAX_NUMBER})")
    return text


def _int(text: str) -> int:
    return int(_number(text))


def _float(text: str) -> float:
    return float(_number(text))


def _constant(text: str) -> Any:
    raise Malformed(f"holds {text}, which is no JSON number")


def loads(data: bytes, limit: int = beneath.MAX_READ) -> Any:
    """``data`` decoded as JSON within the bounds above; Malformed saying why otherwise."""
    if len(data) > limit:
        raise Malformed(f"holds more than {limit} bytes")
    why = _depth_error(data)
    if why is not None:
        raise Malformed(why)
    try:
        return json.loads(data.decode(), parse_int=_int, parse_float=_float, parse_constant=_constant)
    except Malformed:
        raise
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise Malformed(f"is not valid JSON: {exc}") from None


def read(dirfd: int, rel: str, limit: int = beneath.MAX_READ) -> Any:
    """The JSON in the plain, singly linked file ``rel`` beneath ``dirfd`` (``beneath.read_file``:
    no link followed, at most ``limit`` bytes read), decoded by ``loads``. Raises what
    ``read_file`` raises (FileNotFoundError, ``beneath.WrongEntry``, OSError) or Malformed."""
    return loads(beneath.read_file(dirfd, rel, limit), limit)
