"""Saving one rank's file of a local format: only that rank's bytes, and a failed write in one line.

Every local writer (``fsdp2_ranks_write``, ``fsdp1_write``) ends in ``save_rank_file``.
``torch.save`` writes a tensor's whole storage, not the part the tensor views, so a
rank's rows read from a memory-mapped source (a view into the source file's storage)
would carry the rows of every other rank too, and DTensor's pickling of a view that
starts inside its storage fails outright ("invalid python storage"). ``own_bytes`` gives
each tensor a storage of exactly its own bytes before it is saved.
"""

from __future__ import annotations

from pathlib import Path

import torch

from shardckpt.formats.files import writing


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


def save_rank_file(state_dict: dict, path: Path) -> Path:
    """``torch.save`` one rank's state dict at ``path``; return ``path``, or raise a one-line error."""
    # Our own file object, closed on any exit: after a failed write, torch's zip writer
    # lives on in the exception's frames, and a descriptor it opened itself would keep
    # the (deleted) partial file, and its filesystem, busy until then.
    with writing(path), open(path, "wb") as stream:
        torch.save(state_dict, stream)
    return path
