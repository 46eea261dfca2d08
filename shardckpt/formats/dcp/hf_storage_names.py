"""``HuggingFaceStorageWriter``'s rank shards, by name: the format told without torch (``hf_storage.py`` reads it)."""

from __future__ import annotations

import re
from pathlib import Path

SHARD_FILE = re.compile(r"shard-(\d{5})-model-(\d{5})-of-(\d{5})\.safetensors")


def looks_like(src: Path) -> bool:
    """Return whether directory ``src`` holds rank shards ``HuggingFaceStorageWriter`` named."""
    try:
        return any(SHARD_FILE.fullmatch(p.name) for p in src.iterdir())
    except OSError:
        return False
