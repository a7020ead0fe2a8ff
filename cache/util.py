"""Small arithmetic and lookup helpers every `cache` module may use (it imports nothing)."""

from __future__ import annotations

from collections.abc import Mapping


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ``a`` by positive ``b``."""
    return -(-a // b)


def round_up(x: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``x``."""
    return cdiv(x, multiple) * multiple


def lookup[V](table: Mapping[str, V], key: str, error: str) -> V:
    """``table[key]``, or ``ValueError(error)`` followed by the allowed keys."""
    try:
        return table[key]
    except KeyError:
        raise ValueError(f"{error}; allowed: {sorted(table)}") from None
