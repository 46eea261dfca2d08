"""torch_checkpointing's directory told from what is on disk, without torch (``reader.py`` reads it)."""

from __future__ import annotations

from pathlib import Path

from shardckpt.core.files import has_file

METADATA_FILE = "metadata.pkl"


def is_torch_checkpointing_dir(path: Path) -> bool:
    """Return whether ``path`` holds torch_checkpointing's ``metadata.pkl``."""
    return has_file(path / METADATA_FILE, path)
