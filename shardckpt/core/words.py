"""How messages count things: ``1 tensor``, ``2 tensors``."""

from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """Return ``n`` and ``noun``, plural unless ``n`` is 1 (``plural`` for irregular nouns)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
