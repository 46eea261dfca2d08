"""Writing ``fsdp2-ranks`` for M target ranks: file r holds what rank r of FSDP2 at M saves.

The process acting for target rank r (``shardckpt.virtual``) builds rank r's state dict
(each split tensor a ``Shard(0)`` DTensor of r's rows on a mesh of M, whole tensors as
they are, plain values) and saves it as ``rank_{r}.pt`` (``rank_names``), each tensor holding only its own bytes
(``rank_file``). The mesh pickles as an
FSDP2 job's 1-D CPU mesh does (``shardckpt.virtual.job_mesh``), so a job at M that
``torch.load``s the file gets DTensors on a mesh that uses its own world process group.
"""

from __future__ import annotations

from pathlib import Path

import torch

from shardckpt.formats.rank_file import own_bytes, save_rank_file
from shardckpt.formats.rank_names import rank_file_name
from shardckpt.tree import TensorMeta, map_leaves
from shardckpt.virtual import job_mesh, shard_dtensor


def write_rank_file(
    directory: Path,
    tree: dict,
    world_size: int,
    rank: int,
    shards: dict[str, torch.Tensor],
    whole: dict[str, torch.Tensor],
) -> Path:
    """Save target rank ``rank``'s state dict of ``tree`` into ``directory``; return the file."""
    mesh = job_mesh(world_size, rank)

    def place(_path, leaf):
        if not isinstance(leaf, TensorMeta):
            return leaf
        if leaf.key in whole:
            return own_bytes(whole[leaf.key])
        return shard_dtensor(own_bytes(shards[leaf.key]), leaf, mesh)

    return save_rank_file(map_leaves(tree, place), directory / rank_file_name(rank))
