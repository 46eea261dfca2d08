"""This process's place in a torchrun launch, read from the environment without importing torch."""

from __future__ import annotations

import os


def env_rank() -> int:
    """Return this process's rank from the environment (0 when standalone)."""
    return int(os.environ.get("RANK", "0"))
