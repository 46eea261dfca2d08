"""What a per-rank file stores against what it holds: a rank file carries only its own bytes."""

from __future__ import annotations

import zipfile
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from shardckpt.formats.sharded_tensor_load import StoredShardedTensor, load_rank_file
from shardckpt.tree import walk


def tensor_bytes(file: Path) -> tuple[int, int]:
    """Return (bytes of the file's storage records, bytes of the tensors it holds locally)."""
    with zipfile.ZipFile(file) as zf:
        stored = sum(i.file_size for i in zf.infolist() if "/data/" in i.filename)
    held = 0
    for _, leaf in walk(load_rank_file(file, trust_pickle=False)):
        if isinstance(leaf, DTensor):
            held += leaf.to_local().nbytes
        elif isinstance(leaf, StoredShardedTensor):
            held += sum(s.tensor.nbytes for s in leaf.local_shards)
        elif isinstance(leaf, torch.Tensor):
            held += leaf.nbytes
    return stored, held


def assert_each_file_holds_only_its_own_bytes(directory: Path, slack: int = 0) -> None:
    """Fail when a file stores more tensor bytes than its tensors hold (plus ``slack``).

    ``torch.save`` writes a tensor's whole storage: a rank's rows saved as a view into
    the source's storage would carry the other ranks' rows too. ``slack`` allows for a
    DTensor's pickled DeviceMesh, which brings a few small tensors of its own.
    """
    for file in sorted(directory.iterdir()):
        stored, held = tensor_bytes(file)
        assert stored <= held + slack, f"{file.name} stores {stored} bytes for {held} of tensors"
