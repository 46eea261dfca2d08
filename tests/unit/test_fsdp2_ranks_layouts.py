"""Layout labels of the ``fsdp2-ranks`` format (no process group)."""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard

from shardckpt.formats.fsdp2.reader import describe_placements


def test_layouts_name_each_placement_over_each_mesh_dimension():
    assert describe_placements([Shard(0)], (4,)) == "Shard(0) over 4"
    assert describe_placements([Replicate(), Shard(0)], (2, 2)) == "Replicate×Shard(0) over 2×2"
