"""veRL's ``FSDPCheckpointManager`` directories: read (FSDP2 and FSDP1) and written at M (FSDP2)."""

from __future__ import annotations

from shardckpt.formats.verl.names import looks_like
from shardckpt.formats.verl.reader import VerlReader
from shardckpt.formats.verl.writer import VerlWriter

__all__ = ["VerlReader", "VerlWriter", "looks_like"]
