"""Checkpoints torch's DCP writers store otherwise than ``FileSystemWriter``'s default.

- ``safetensors_dcp.py``: ``dcp-safetensors``, a DCP directory whose tensors are
  safetensors blobs (``serialization_format=SAFETENSORS``);
- ``hf_storage.py``: ``hf-storage``, ``HuggingFaceStorageWriter``'s per-rank shards,
  with no ``.metadata``.

Both are read through ``DcpReader`` once their chunks are placed
(``safetensors_header.py``), rows straight from the raw data (``raw_rows.py``); both are
sources only (``read_only.py``).
"""

from __future__ import annotations

from shardckpt.formats.dcp_variants.hf_storage import HfStorageReader
from shardckpt.formats.dcp_variants.hf_storage import looks_like as looks_like_hf_storage
from shardckpt.formats.dcp_variants.read_only import ReadOnlyWriter
from shardckpt.formats.dcp_variants.safetensors_dcp import DcpSafetensorsReader
from shardckpt.formats.dcp_variants.safetensors_dcp import looks_like as looks_like_safetensors

__all__ = [
    "DcpSafetensorsReader",
    "HfStorageReader",
    "ReadOnlyWriter",
    "looks_like_hf_storage",
    "looks_like_safetensors",
]
