"""Integer arithmetic every floor shares (a leaf: it imports nothing of the project)."""

from __future__ import annotations

__all__ = ["cdiv"]


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers (b > 0): blocks for a token count, chunks for a length."""
    return -(-a // b)
