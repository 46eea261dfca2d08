"""What per-rank files store: only their own bytes, and torch's own shards; files' hashes."""

from __future__ import annotations

import hashlib
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from shardckpt.formats.fsdp2.reader import quiet_mesh_unpickling
from shardckpt.formats.ranks.sharded_tensor_load import StoredShardedTensor, load_rank_file
from shardckpt.state.tree import subtree, walk


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


def file_hashes(root: Path) -> dict[str, str]:
    """Return the SHA-256 of every file under ``root`` (or of ``root``), by relative path."""
    paths = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


def assert_rank_files_hold_torchs_shards(
    dst: Path | Callable[[int], Path], ref: dict, world_size: int
) -> None:
    """Check every ``rank_{r}.pt``: each DTensor's local shard is what torch gives rank r of the full tensor.

    ``dst`` is the directory of every rank's file, or gives each rank's (node-local disks).
    """
    checked = 0
    for rank in range(world_size):
        directory = dst(rank) if callable(dst) else dst
        with quiet_mesh_unpickling():
            state = torch.load(directory / f"rank_{rank}.pt", weights_only=True)
        for path, leaf in walk(state):
            full = subtree(ref, path)
            if isinstance(leaf, DTensor):
                sizes, offsets = compute_local_shape_and_global_offset(
                    leaf.shape, leaf.device_mesh, leaf.placements
                )
                window = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
                assert torch.equal(leaf.to_local(), full[window]), (rank, path)
                checked += 1
            elif isinstance(leaf, torch.Tensor):
                assert torch.equal(leaf, full), (rank, path)
            else:
                assert leaf == full, (rank, path)
    assert checked, "no DTensor was checked"
