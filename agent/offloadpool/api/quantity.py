"""Kubernetes quantities (``64Gi``, ``1.5Ki``, ``2e9``, ``1073741824``) as whole bytes.

The CRD accepts quantities the way Kubernetes does (an integer or a string with a binary or
decimal suffix or an exponent) and its CEL rules insist the result is a whole, positive number
of bytes. This module reads them the same way, exactly (``fractions.Fraction``, no floats), so
the agent and the API server never disagree about a size.
"""

from __future__ import annotations

import re
from fractions import Fraction

INT64_MAX = 2**63 - 1

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 10**3),
    "": Fraction(1),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
}
# Kubernetes' grammar: <sign><number><suffix>, suffix a binary SI, a decimal SI or e<int>.
_QUANTITY = re.compile(
    r"^(?P<sign>[+-]?)(?P<number>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
    r"(?:(?P<binary>[KMGTPE]i)|(?P<decimal>[numkMGTPE])|[eE](?P<exp>[+-]?[0-9]+))?$"
)


class QuantityError(ValueError):
    """Not a quantity, or not a whole, representable number of bytes."""


def parse_quantity_exact(value: int | str) -> Fraction:
    """The exact value of a quantity (may be fractional or negative)."""
    if isinstance(value, bool):
        raise QuantityError(f"{value!r} is not a quantity")
    if isinstance(value, int):
        return Fraction(value)
    if not isinstance(value, str):
        raise QuantityError(f"{value!r} is not a quantity (expected an integer or a string)")
    m = _QUANTITY.match(value)
    if not m or len(value) > 64:
        raise QuantityError(f"{value!r} is not a quantity (examples: 64Gi, 512Mi, 1073741824, 2e9)")
    number = Fraction(m["number"] if not m["number"].endswith(".") else m["number"][:-1])
    if m["binary"]:
        number *= _BINARY[m["binary"]]
    elif m["decimal"] is not None:
        number *= _DECIMAL[m["decimal"]]
    elif m["exp"] is not None:
        exp = int(m["exp"])
        if abs(exp) > 40:
            raise QuantityError(f"{value!r}: exponent out of range")
        number *= Fraction(10) ** exp
    return -number if m["sign"] == "-" else number


def parse_quantity(value: int | str) -> int:
    """Bytes in ``value``: ``parse_quantity("64Gi") == 68719476736``.

    Raises QuantityError for anything that is not a quantity, not a whole number of bytes
    (``100m``, ``0.5``) or outside int64, as the API server's ``isInteger()`` does.
    """
    exact = parse_quantity_exact(value)
    if exact.denominator != 1:
        raise QuantityError(f"{value!r} is not a whole number of bytes")
    n = int(exact)
    if not -INT64_MAX - 1 <= n <= INT64_MAX:
        raise QuantityError(f"{value!r} does not fit in 64 bits")
    return n


def format_quantity(n: int) -> str:
    """The shortest exact binary-suffixed form: 68719476736 -> ``64Gi``, 1000 -> ``1000``."""
    if n == 0:
        return "0"
    for suffix, factor in sorted(_BINARY.items(), key=lambda kv: -kv[1]):
        if n % factor == 0:
            return f"{n // factor}{suffix}"
    return str(n)
