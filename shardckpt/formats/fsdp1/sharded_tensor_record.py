"""Writing a ``ShardedTensor`` for rank r of M without being rank r of a job of M.

``ShardedTensor.__getstate__`` asks the default process group for the rank and world
size, so a real ShardedTensor can only be saved from inside a job of M. A
``ShardedTensorRecord`` pickles to exactly what ``torch.save`` writes for that
ShardedTensor: ``_rebuild_from_type_v2`` of a wrapper subclass of type
``ShardedTensor``, with the state ``(local_shards, metadata, ProcessGroupState,
sharding_spec, init_rrefs)`` built from torch's own classes. Rank r of a job of M
loads it with ``torch.load`` like any file FSDP1 saved.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardckpt.core.torch_internals import sharded_tensor
from shardckpt.formats.ranks.rank_file import own_bytes


class ShardedTensorRecord:
    """Pickles as the ``ShardedTensor`` rank ``rank`` of ``world_size`` holds with ``local`` at ``offset``."""

    def __init__(
        self,
        local: torch.Tensor | None,
        shape: Sequence[int],
        dtype: torch.dtype,
        dim0_shards: Sequence[tuple[int, int, int]],
        rank: int,
        world_size: int,
    ):
        """``dim0_shards``: every rank's non-empty shard as ``(rank, first row, rows)``.

        ``local`` is saved with only its own bytes (``rank_file.own_bytes``), never the
        rest of a source storage it may view.
        """
        self.api = sharded_tensor()
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.rank = rank
        self.world_size = world_size
        rest = list(self.shape[1:])
        self.shards_metadata = [
            self.api.ShardMetadata([first] + [0] * len(rest), [rows] + rest, f"rank:{q}/cpu")
            for q, first, rows in dim0_shards
        ]
        mine = [m for (q, _, _), m in zip(dim0_shards, self.shards_metadata) if q == rank]
        self.local_shards = (
            [self.api.Shard(own_bytes(local), mine[0])] if mine and local is not None else []
        )

    def __reduce_ex__(self, protocol):
        api = self.api
        properties = api.TensorProperties(
            self.dtype, torch.strided, False, torch.contiguous_format, False
        )
        metadata = api.ShardedTensorMetadata(self.shards_metadata, self.shape, properties)
        pg_state = api.ShardedTensor.ProcessGroupState(
            self.rank, self.rank, self.world_size, self.world_size
        )
        spec = api.ChunkShardingSpec(dim=0, placements=[m.placement for m in self.shards_metadata])
        stride = torch.empty(self.shape, device="meta").stride()
        args = (
            api.ShardedTensor,
            self.dtype,
            tuple(self.shape),
            stride,
            0,
            torch.strided,
            torch.device("cpu"),
            False,
        )
        state = (self.local_shards, metadata, pg_state, spec, False)
        rebuild = (api.rebuild_wrapper_subclass, api.ShardedTensor, args, state)
        return (api.rebuild_from_type_v2, rebuild)
