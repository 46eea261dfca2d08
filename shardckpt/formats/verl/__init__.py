"""veRL's ``FSDPCheckpointManager`` directories, FSDP2 (``verl``) and FSDP1 (``verl-fsdp1``): read, and written at M."""

from __future__ import annotations

from shardckpt.formats.verl.names import detect
from shardckpt.formats.verl.reader import VerlReader
from shardckpt.formats.verl.writer import VerlFsdp1Writer, VerlWriter

__all__ = ["VerlFsdp1Writer", "VerlReader", "VerlWriter", "detect"]
