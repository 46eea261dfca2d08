"""One rank's file of a local format, laid out before its data: each tensor only its own bytes.

Every local writer (``fsdp2_ranks_write``, ``fsdp1_write``) frames its files here
(``frame_rank_file``), saying what fills each placeholder storage (``fill_whole``,
``fill_rows``).
``torch.save`` writes a tensor's whole storage, not the part the tensor views, so a
rank's rows read from a memory-mapped source (a view into the source file's storage)
would carry the rows of every other rank too, and DTensor's pickling of a view that
starts inside its storage fails outright ("invalid python storage"). ``own_bytes`` gives
each tensor a storage of exactly its own bytes before it is saved.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from shardckpt.formats.base import Frame
from shardckpt.formats.torch_file import skeleton_regions, storage_of
from shardckpt.regions import row_elements
from shardckpt.target_ranks import create
from shardckpt.tree import TensorMeta


def own_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """Return ``tensor`` itself when its storage is exactly its bytes, else a contiguous copy of it."""
    t = tensor.detach()
    if (
        t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    ):
        return t
    return t.clone(memory_format=torch.contiguous_format)


Fills = dict[int, list[tuple[str, int, int, int]]]
"""For each placeholder storage (``_cdata``): ``(key, start, stop, byte)`` entries, elements
[start, stop) of source tensor ``key`` at that byte of the storage."""


def frame_rank_file(path: Path, state_dict: dict, fills: Fills) -> Frame:
    """Write the ``torch.save`` skeleton of one rank's ``state_dict`` of placeholders at ``path``.

    Returns the regions that fill it (``fills``), as a rank's file of the format is
    read back: each tensor holding only its own bytes.
    """
    fd = create(path)
    try:
        return skeleton_regions(fd, 0, state_dict, fills, path.name)
    finally:
        os.close(fd)


def fill_whole(fills: Fills, placeholder: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    """Note that ``placeholder`` holds all of ``meta``; return it."""
    fills.setdefault(storage_of(placeholder), []).append((meta.key, 0, meta.numel, 0))
    return placeholder


def fill_rows(
    fills: Fills, placeholder: torch.Tensor, meta: TensorMeta, rows: tuple[int, int]
) -> torch.Tensor:
    """Note that ``placeholder`` holds rows [a, b) of ``meta``; return it."""
    row = row_elements(meta)
    fills.setdefault(storage_of(placeholder), []).append(
        (meta.key, rows[0] * row, rows[1] * row, 0)
    )
    return placeholder
