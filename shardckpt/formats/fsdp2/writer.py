"""Writing ``fsdp2-ranks`` for M target ranks: file r holds what rank r of FSDP2 at M saves.

The process acting for target rank r (``shardckpt.formats.ranks.target_ranks``) lays out rank r's
state dict (each split tensor a ``Shard(0)`` DTensor of r's rows on a mesh of M, whole
tensors as they are, plain values) as a ``torch.save`` skeleton at ``rank_{r}.pt``
(``rank_names``), each tensor with a storage of only its own bytes; the engine then
fills each storage from the source. The mesh pickles as an FSDP2 job's 1-D CPU mesh
does (``shardckpt.formats.ranks.target_ranks.job_mesh``), so a job at M that ``torch.load``s the
file gets DTensors on a mesh that uses its own world process group.
"""

from __future__ import annotations

from shardckpt.formats.base import Frame
from shardckpt.formats.ranks.rank_file import Fills, dtensor_placeholders, frame_rank_file
from shardckpt.formats.ranks.rank_names import rank_file_name
from shardckpt.formats.ranks.target_ranks import TargetRanksWriter, job_mesh


class Fsdp2RanksWriter(TargetRanksWriter):
    """``rank_{r}.pt`` of DTensors, for each target rank r a process acts for."""

    def frame_rank(self, rank: int) -> Frame:
        fills: Fills = {}
        mesh = job_mesh(self.plan.world_size, rank)
        state_dict = dtensor_placeholders(self.plan, rank, mesh, fills)
        return frame_rank_file(self.root / rank_file_name(rank), state_dict, fills)
