"""Target ranks: the ranks of a world size M that one real process acts for, and their writer.

A launch of N processes writes a checkpoint for M ranks by letting each real rank act
for some of the target ranks (``shardckpt.core.placement``: k, k + N, k + 2N, ... where every
rank sees DST). Each target rank's shards are real DTensors, placed
``Shard(0)`` on a 1-D mesh of M ranks built without a process group and told which
rank it is, so DCP plans them exactly as it plans FSDP2's own state dict at M.
"""

from __future__ import annotations

import os
from abc import abstractmethod
from pathlib import Path

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from shardckpt.core.files import writing
from shardckpt.core.torch_internals import mesh_without_group, name_groups
from shardckpt.formats.base import Frame, Writer
from shardckpt.state.tree import TensorMeta


def virtual_mesh(world_size: int, rank: int) -> DeviceMesh:
    """Return a 1-D CPU mesh of ``world_size`` ranks, as seen from ``rank``, with no process group.

    DTensor's checkpoint planning only asks the mesh for its shape and this rank's
    coordinate, which such a mesh gives without joining ``world_size`` processes.
    """
    return mesh_without_group(world_size, rank)


# The name of the world process group in every job: the default group is created first.
WORLD_GROUP_NAME = "0"


def job_mesh(world_size: int, rank: int) -> DeviceMesh:
    """Return ``virtual_mesh`` as it pickles from rank ``rank`` of a job at ``world_size``.

    ``init_device_mesh(device, (world_size,))`` in a job gives its one dimension the
    world group, and a pickled mesh keeps only that group's name; a job that unpickles
    the mesh looks the name up among its own groups. Naming the world group here makes
    a saved DTensor usable (``full_tensor``, redistribution) in the job that loads it.
    """
    mesh = virtual_mesh(world_size, rank)
    name_groups(mesh, [WORLD_GROUP_NAME])
    return mesh


def shard_dtensor(local: torch.Tensor, meta: TensorMeta, mesh: DeviceMesh) -> DTensor:
    """Return the DTensor whose shard on ``mesh``'s rank is ``local`` (``Shard(0)``, as FSDP2)."""
    stride = torch.empty(meta.shape, device="meta").stride()
    return DTensor.from_local(
        local.cpu(),
        mesh,
        [Shard(0)],
        run_check=False,
        shape=torch.Size(meta.shape),
        stride=stride,
    )


class TargetRanksWriter(Writer):
    """A DST of one or more files per target rank: each process frames and fills its target ranks'.

    A format says, for target rank r, which rows of which tensors go where in r's files
    (``frame_rank``); the engine fills them, batch by batch, like any other output.
    """

    def frame(self, runtime) -> Frame:
        targets = self.targets(runtime)
        return runtime.agreed(lambda: merge_frames(self.frame_rank(r) for r in targets))

    @abstractmethod
    def frame_rank(self, rank: int) -> Frame:
        """Create target rank ``rank``'s files and return the regions that fill them."""


def merge_frames(frames) -> Frame:
    """Return one ``Frame`` holding the work of ``frames``."""
    out = Frame()
    for frame in frames:
        out.regions += frame.regions
        out.records += frame.records
        out.pieces += frame.pieces
        out.files += frame.files
    return out


def create(path: Path) -> int:
    """Create (or empty) file ``path`` for writing and return its descriptor."""
    with writing(path):
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
