"""The world sizes a dim-0 split fits, checked against torch's own ``Shard(0)`` split."""

from __future__ import annotations

import pytest

from shardckpt.formats.ranks.dim0_split import (
    WorldSizes,
    consistent_world_sizes,
    describe_chunks,
    infer_world_sizes,
    torch_split,
)
from shardckpt.state.tree import Chunk


def chunks_of(n: int, world_size: int, cols: int = 3) -> tuple[Chunk, ...]:
    """Return what DCP stores of ``n`` rows split by torch over ``world_size`` (one empty chunk)."""
    rows = torch_split(n, world_size)
    stored = [Chunk(r, (off, 0), (size, cols)) for r, (off, size) in enumerate(rows)]
    if len(rows) < world_size:
        stored.append(Chunk(len(rows), (n, 0), (0, cols)))
    return tuple(stored)


@pytest.mark.parametrize("n", [1, 3, 7, 48, 97, 300])
@pytest.mark.parametrize("world_size", [2, 3, 5, 8, 32])
def test_every_world_size_in_the_range_gives_the_same_split_and_the_true_one_is_in_it(
    n, world_size
):
    rows = torch_split(n, world_size)
    fits = consistent_world_sizes(n, rows, empty=len(rows) < world_size)
    assert fits is not None and fits.low <= world_size
    assert fits.high is None or world_size <= fits.high
    for m in range(fits.low, (fits.high or fits.low + 40) + 1):
        assert torch_split(n, m) == rows


def test_tensors_of_one_checkpoint_pin_the_world_size_together():
    # 97 rows fit 25..32 ranks, 300 rows 30..33 and a stored empty chunk says more than 30
    # ranks: together 31..32; a file for rank 31 pins 32.
    tensors = [((97, 3), chunks_of(97, 32)), ((300, 3), chunks_of(300, 32))]
    assert infer_world_sizes(tensors) == WorldSizes(31, 32)
    assert infer_world_sizes(tensors, 32) == WorldSizes(32, 32)
    assert describe_chunks((97, 3), tensors[0][1], WorldSizes(32, 32)) == "Shard(0) over 32"
    assert describe_chunks((97, 3), tensors[0][1], WorldSizes(31, 32)) == "Shard(0) over ≥31"


def test_splits_that_disagree_name_no_world_size():
    tensors = [((97, 3), chunks_of(97, 32)), ((97, 3), chunks_of(97, 4))]
    assert infer_world_sizes(tensors) is None
    assert describe_chunks((97, 3), tensors[1][1], None) == "Shard(0) in 4 chunks"


def test_labels_of_whole_and_other_chunks():
    assert describe_chunks((7, 3), (Chunk(0, (0, 0), (7, 3)),), 4) == "full"
    # One rank holds all of a 1-row tensor, the others an empty chunk: split over 4.
    assert describe_chunks((1, 3), chunks_of(1, 4), 4) == "Shard(0) over 4"
    cols = (Chunk(0, (0, 0), (7, 2)), Chunk(1, (0, 2), (7, 1)))
    assert describe_chunks((7, 3), cols, 2) == "2 chunks"
