"""Saving one rank's file of a local format: only that rank's bytes, and a failed write in one line.

Every local writer (``fsdp2_ranks_write``, ``fsdp1_write``) ends in ``save_rank_file``.
``torch.save`` writes a tensor's whole storage, not the part the tensor views, so a
rank's rows read from a memory-mapped source (a view into the source file's storage)
would carry the rows of every other rank too, and DTensor's pickling of a view that
starts inside its storage fails outright ("invalid python storage"). ``own_bytes`` gives
each tensor a storage of exactly its own bytes before it is saved.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import torch

from shardckpt.errors import IOFailure
from shardckpt.formats.files import os_error

# How torch's zip writer (caffe2's inline_container.cc) words a write that failed.
_ZIP_WRITER_FAILURES = ("PytorchStreamWriter", "inline_container")


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
    try:
        # Our own file object, closed on any exit: after a failed write, torch's zip
        # writer lives on in the exception's frames, and a descriptor it opened itself
        # would keep the (deleted) partial file, and its filesystem, busy until then.
        with open(path, "wb") as stream:
            torch.save(state_dict, stream)
    except OSError as exc:
        raise os_error(exc, path, writing=True) from None
    except RuntimeError as exc:
        if not any(mark in str(exc) for mark in _ZIP_WRITER_FAILURES):
            raise
        # torch's zip writer reports a failed write without its errno ("unexpected pos
        # 576 vs 534", "PytorchStreamWriter failed writing file data/0"): a full
        # filesystem is by far the usual cause, and it is visible afterwards.
        if _is_full(path.parent):
            raise os_error(
                OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), path, writing=True
            ) from None
        text = str(exc).strip().splitlines()
        raise IOFailure(
            f"writing failed ({text[0] if text else type(exc).__name__})",
            path=path,
            hint="check the free space and the filesystem DST is on",
        ) from None
    return path


def _is_full(directory: Path) -> bool:
    """Return whether the filesystem of ``directory`` has no block left for this process."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return False
    return st.f_bavail == 0 or st.f_bfree == 0
