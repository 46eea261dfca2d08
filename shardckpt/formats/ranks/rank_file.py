"""One rank's file of a local format, laid out before its data: each tensor only its own bytes.

Every local writer (``fsdp2_ranks_write``, ``fsdp1_write``) frames its files here
(``frame_rank_file``), saying what fills each placeholder storage (``placeholder_whole``,
``placeholder_rows``, ``dtensor_placeholders``).
``torch.save`` writes a tensor's whole storage, not the part the tensor views, so a
rank's rows read from a memory-mapped source (a view into the source file's storage)
would carry the rows of every other rank too, and DTensor's pickling of a view that
starts inside its storage fails outright ("invalid python storage"). ``own_bytes`` gives
each tensor a storage of exactly its own bytes before it is saved.
"""

from __future__ import annotations

from pathlib import Path

import torch

from shardckpt.codecs.zip_skeleton import fake_mode
from shardckpt.formats.base import Frame
from shardckpt.formats.ranks.target_ranks import shard_dtensor
from shardckpt.formats.torch_save.file import skeleton_file, storage_of
from shardckpt.state.regions import dim0_rows, row_elements
from shardckpt.state.tree import TensorMeta, map_leaves


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
"""For each placeholder storage (``storage_key``): ``(key, start, stop, byte)`` entries, elements
[start, stop) of source tensor ``key`` at that byte of the storage."""


def frame_rank_file(path: Path, state_dict: dict, fills: Fills) -> Frame:
    """Write the ``torch.save`` skeleton of one rank's ``state_dict`` of placeholders at ``path``.

    Returns the regions that fill it (``fills``), as a rank's file of the format is
    read back: each tensor holding only its own bytes.
    """
    return skeleton_file(path, state_dict, fills, path.name)


def placeholder_whole(fills: Fills, meta: TensorMeta) -> torch.Tensor:
    """Return a placeholder for all of ``meta``, noted in ``fills`` (inside ``fake_mode``)."""
    placeholder = torch.empty(meta.shape, dtype=meta.dtype)
    fills.setdefault(storage_of(placeholder), []).append((meta.key, 0, meta.numel, 0))
    return placeholder


def placeholder_rows(fills: Fills, meta: TensorMeta, world_size: int, rank: int) -> torch.Tensor:
    """Return a placeholder for ``rank``'s ``Shard(0)`` rows of ``meta`` at ``world_size``, noted in ``fills``."""
    rows = dim0_rows(meta.shape, world_size, rank)
    local = torch.empty((rows[1] - rows[0], *meta.shape[1:]), dtype=meta.dtype)
    row = row_elements(meta)
    fills.setdefault(storage_of(local), []).append((meta.key, rows[0] * row, rows[1] * row, 0))
    return local


def dtensor_placeholders(plan, rank: int, mesh, fills: Fills) -> dict:
    """Return target rank ``rank``'s state dict of ``plan.tree``, as FSDP2 holds it, in placeholders.

    Tensors in ``plan.whole`` are plain tensors; every other tensor is a ``Shard(0)``
    DTensor of ``rank``'s rows on ``mesh``; plain values are themselves.
    """

    def place(_path, leaf):
        if not isinstance(leaf, TensorMeta):
            return leaf
        if leaf.key in plan.whole:
            return placeholder_whole(fills, leaf)
        return shard_dtensor(placeholder_rows(fills, leaf, plan.world_size, rank), leaf, mesh)

    with fake_mode():
        return map_leaves(plan.tree, place)
