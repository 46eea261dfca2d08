"""Where ZeRO puts each parameter's elements (``formats/deepspeed/partitions.py``, pure): pieces
tile every parameter exactly once, start mid-row where a partition ends mid-row, and
partitions that cannot hold what the metadata lists are refused with the reason."""

from __future__ import annotations

import math

import pytest

from shardckpt.formats.trainers.deepspeed.partitions import (
    LayoutError,
    Piece,
    check_fragments,
    zero3,
    zero12,
)

SHAPES = (("a", (11, 6)), ("b", (7, 6)), ("c", (6, 7)))  # 66 + 42 + 42 = 150 elements


def tiles(placed) -> None:
    """Assert every parameter's pieces cover [0, numel) in order, without overlap."""
    for p in placed:
        at = 0
        for piece in p.pieces:
            assert piece.start == at and piece.numel > 0
            at += piece.numel
        assert at == math.prod(p.shape), p.fqn


def test_zero12_splits_a_parameter_where_a_rank_partition_ends():
    # 150 elements over 2 ranks, padded to 152: partitions of 76, rank 1 stores 74.
    placed = zero12(0, SHAPES, (0, 0, 0), (76, 74), 76, lean=True)
    tiles(placed)
    assert placed[1].pieces == (Piece(0, 0, 66, 0, 10), Piece(1, 0, 0, 10, 32))
    assert placed[2].pieces == (Piece(1, 0, 32, 0, 42),)


def test_zero12_skips_alignment_padding_between_parameters():
    placed = zero12(3, (("a", (3,)), ("b", (5,))), (1, 0), (5, 4), 5, lean=True)
    assert [p.pieces for p in placed] == [
        (Piece(0, 3, 0, 0, 3),),
        (Piece(0, 3, 4, 0, 1), Piece(1, 3, 0, 1, 4)),
    ]


def test_zero12_whole_partitions_of_bf16_optimizer_hold_their_padding():
    placed = zero12(0, SHAPES, (0, 0, 0), (76, 76), 76, lean=False)
    tiles(placed)
    with pytest.raises(LayoutError, match="take 150 elements, but the ranks' partitions hold 152"):
        zero12(0, SHAPES, (0, 0, 0), (76, 76), 76, lean=True)


def test_zero12_refuses_partitions_too_small_for_the_parameters():
    with pytest.raises(LayoutError) as err:
        zero12(0, SHAPES, (0, 0, 0), (76, 30), 76, lean=True)
    assert (
        str(err.value)
        == "'b' needs elements up to 32 of rank 1's partition of group 0, which holds 30"
    )
    with pytest.raises(LayoutError) as err:
        zero12(0, SHAPES, (0, 0, 0), (50, 50), 50, lean=True)
    assert str(err.value) == "'b' ends past the last partition of group 0 (2 ranks of 50 elements)"
    with pytest.raises(LayoutError, match="lists 3 parameters but 2 alignment paddings"):
        zero12(0, SHAPES, (0, 0), (76, 74), 76, lean=True)


def test_zero3_cuts_each_parameter_into_ceil_numel_over_w_per_rank():
    placed = zero3(1, (("a", (7,)), ("b", (2, 3))), (5, 5, 5))
    tiles(placed)
    assert placed[0].pieces == (Piece(0, 1, 0, 0, 3), Piece(1, 1, 0, 3, 3), Piece(2, 1, 0, 6, 1))
    assert placed[1].pieces == (Piece(0, 1, 3, 0, 2), Piece(1, 1, 3, 2, 2), Piece(2, 1, 3, 4, 2))
    with pytest.raises(LayoutError) as err:
        zero3(1, (("a", (7,)), ("b", (2, 3))), (5, 4, 5))
    assert str(err.value) == (
        "rank 1's flat tensor of sub-group 1 holds 4 elements, but its parameters take 5 "
        "(3 ranks of ceil(numel / 3) each)"
    )


def test_a_parameter_with_fewer_elements_than_ranks_is_on_the_first_ranks_only():
    (p,) = zero3(0, (("s", (2,)),), (1, 1, 1, 1))
    assert p.pieces == (Piece(0, 0, 0, 0, 1), Piece(1, 0, 0, 1, 1))


def test_param_slice_mappings_confirm_or_refuse_the_layout():
    placed = zero12(0, SHAPES, (0, 0, 0), (76, 74), 76, lean=True)
    mappings = [{"a": (66, 0), "b": (10, 66)}, {"b": (32, 0), "c": (42, 32)}]
    check_fragments(placed, mappings)
    mappings[1]["c"] = (42, 30)
    with pytest.raises(LayoutError) as err:
        check_fragments(placed, mappings)
    assert str(err.value) == (
        "'c' would be 42 elements at 32 of rank 1's partition of group 0, but "
        "param_slice_mappings says 42 at 30"
    )
