"""Lightning's sharded checkpoint told from what is on disk, without torch (``lightning.py`` reads it)."""

from __future__ import annotations

from pathlib import Path

from shardckpt.core.files import has_file
from shardckpt.formats.dcp.reader import is_dcp_dir

META_FILE = "meta.pt"
"""What rank 0 ``torch.save``s beside the DCP part: everything but modules and optimizers."""


def looks_like(src: Path) -> bool:
    """Return whether directory ``src`` is Lightning's sharded checkpoint: DCP with ``meta.pt`` beside it."""
    return is_dcp_dir(src) and has_file(src / META_FILE, src)
