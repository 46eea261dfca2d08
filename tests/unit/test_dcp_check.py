"""The chunk overlap sweep of ``dcp_check`` is exact for boxes of any rank."""

from __future__ import annotations

import itertools
import random

import pytest

from shardckpt.formats.dcp.check import _first_overlap


def _overlap_by_brute_force(boxes) -> bool:
    def cells(box):
        offsets, sizes = box
        return set(itertools.product(*(range(o, o + s) for o, s in zip(offsets, sizes))))

    seen: set = set()
    for box in boxes:
        mine = cells(box)
        if mine & seen:
            return True
        seen |= mine
    return False


@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_the_chunk_overlap_sweep_agrees_with_brute_force(ndim):
    rng = random.Random(ndim)
    for _ in range(300):
        boxes = [
            (
                tuple(rng.randrange(6) for _ in range(ndim)),
                tuple(rng.randrange(4) for _ in range(ndim)),
            )
            for _ in range(rng.randrange(1, 6))
        ]
        found = _first_overlap(boxes)
        assert (found is not None) == _overlap_by_brute_force(boxes), boxes
        if found is not None:
            assert _overlap_by_brute_force(list(found))


def test_a_grid_of_fsdp_by_tp_chunks_passes_and_one_shifted_column_is_found():
    rows, cols = [(0, 3), (3, 3), (6, 1)], [(0, 24), (24, 24)]
    grid = [((r, c), (rs, cs)) for r, rs in rows for c, cs in cols]
    assert _first_overlap(grid) is None
    shifted = grid[:-1] + [((6, 20), (1, 24))]
    assert _first_overlap(shifted) is not None
