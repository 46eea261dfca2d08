"""Rows of DCP chunks stored as raw data (safetensors), read where the storage entry says.

A safetensors file stores each tensor's elements row-major, little-endian, from the
byte its header names; once that byte is the chunk's storage entry
(``safetensors_header.placed_metadata``), ``StoredRows`` reads its rows as it reads a
``torch.save``'d chunk's, and nothing goes through DCP's loader.
"""

from __future__ import annotations

import sys

from shardckpt.core.errors import UsageError
from shardckpt.core.lazy_torch import torch
from shardckpt.formats.dcp.rows import Placed, StoredRows


class RawRows(StoredRows):
    """``StoredRows`` for chunks whose storage entry is the first byte of their raw data."""

    def locate(self, info, key: str, offsets: tuple, sizes: tuple, dtype: torch.dtype) -> Placed:
        if sys.byteorder != "little":
            raise UsageError(
                f"safetensors data is little-endian and this machine is {sys.byteorder}-endian",
                path=self.src / info.relative_path,
                hint="convert on a little-endian machine",
            )
        return Placed(info.relative_path, info.offset)
