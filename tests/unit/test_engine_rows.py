"""The rows a step reads: one request for shards a few KB apart, separate ones far apart."""

from __future__ import annotations

import torch

from shardckpt.engine.rows import GAP_BYTES, read_regions
from shardckpt.state.regions import Region
from shardckpt.state.tree import TensorMeta


class _Source:
    """Rows of real tensors, noting each (key, rows) asked for."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors
        self.asked: list[tuple[str, tuple[int, int] | None]] = []

    def read_spans(self, requests, runtime):
        self.asked += [(meta.key, rows) for meta, rows in requests]
        return [
            self.tensors[meta.key] if rows is None else self.tensors[meta.key][rows[0] : rows[1]]
            for meta, rows in requests
        ]


def _every_other_shard(key: str, rows: int, row: int, shards: int) -> list[Region]:
    """Return the regions of shards 0, 2, 4, ...: what a process acting for every other rank writes."""
    per = rows // shards
    return [
        Region(key, r * per * row, (r + 1) * per * row, f"f{r}", 0) for r in range(0, shards, 2)
    ]


def test_shards_of_a_small_tensor_a_shard_apart_are_read_with_one_request():
    small = torch.arange(64 * 4, dtype=torch.float32).reshape(64, 4)
    source = _Source({"w": small})
    metas = {"w": TensorMeta("w", (64, 4), torch.float32)}
    regions = _every_other_shard("w", 64, 4, 8)
    lookup, read = read_regions(source, regions, metas, runtime=None)
    assert source.asked == [("w", (0, 56))]
    for region in regions:
        expected = small.reshape(-1)[region.start : region.stop].numpy().tobytes()
        assert bytes(lookup(region)) == expected
    assert read == 56 * 4 * 4


def test_shards_further_apart_than_the_gap_are_read_apart():
    row = GAP_BYTES // 4  # one row is the gap's size: a shard of two rows is past it
    big = torch.arange(16 * row, dtype=torch.float32).reshape(16, row)
    source = _Source({"w": big})
    metas = {"w": TensorMeta("w", (16, row), torch.float32)}
    regions = _every_other_shard("w", 16, row, 8)
    lookup, _ = read_regions(source, regions, metas, runtime=None)
    assert source.asked == [("w", (0, 2)), ("w", (4, 6)), ("w", (8, 10)), ("w", (12, 14))]
    assert bytes(lookup(regions[1])) == big[4:6].numpy().tobytes()
