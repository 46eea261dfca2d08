"""How DeepSpeed cuts each param group for M ranks, as its optimizers do when a job starts (pure).

ZeRO-1/2 (``DeepSpeedZeroOptimizer.__init__``): a group's parameters, in order, each
followed by its alignment padding (none unless ``zero_optimization.parameter_alignment``,
then up to a multiple of 16 bytes, none after the last), are one flat buffer padded at
the end to a multiple of ``2 * M`` elements (``nccl_start_alignment_factor``) and cut
into M equal partitions. Each rank saves its partition without the end padding that
falls in it (``group_paddings``), its optimizer state with it.

ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``): each parameter is cut into ``ceil(numel / M)``
elements per rank, the last rank's padded; a group's parameters go into sub-groups of
at least ``sub_group_size`` elements per rank (``_create_fp16_sub_groups``), and a rank's
flat tensor of a sub-group is its partitions of them one after another.

The pieces of each parameter come from ``partitions``, the reader's placing, so what is
written is read back by the same rules.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from shardckpt.formats.trainers.deepspeed.partitions import Placed, zero3, zero12

NCCL_START_ALIGNMENT = 2
"""``DeepSpeedZeroOptimizer.nccl_start_alignment_factor``: a group is padded to a multiple
of this many elements per rank."""


@dataclass(frozen=True)
class FlatGroup:
    """One flat tensor of every rank (ZeRO-1/2: a param group; ZeRO-3: a sub-group) at M."""

    group: int
    """The param group it belongs to."""
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    placed: tuple[Placed, ...]
    partition: int
    """The elements of each rank's partition, padding included."""
    stored: tuple[int, ...]
    """The elements each rank saves of its fp32 partition (ZeRO-1/2: without the end padding)."""
    paddings: tuple[int, ...] = ()
    """ZeRO-1/2: the alignment padding after each parameter (``param_alignment_paddings``)."""
    end_paddings: tuple[int, ...] = ()
    """ZeRO-1/2: the padding at the end of each rank's partition (``group_paddings``)."""


def param_alignment(element_size: int, aligned: bool) -> int:
    """Return the elements a parameter is padded to a multiple of (1 without ``parameter_alignment``)."""
    return 16 // math.gcd(16, element_size) if aligned else 1


def zero12_group(
    group: int, shapes: Sequence[tuple[str, tuple[int, ...]]], world: int, alignment: int = 1
) -> FlatGroup:
    """Return param group ``group`` (``shapes`` in flat order) cut for ``world`` ranks as ZeRO-1/2 cuts it."""
    paddings, offset = [], 0
    for i, (_, shape) in enumerate(shapes):
        offset += math.prod(shape)
        padding = 0 if i == len(shapes) - 1 else (-offset) % alignment
        paddings.append(padding)
        offset += padding
    unit = NCCL_START_ALIGNMENT * world
    partition = math.ceil(offset / unit) * unit // world
    end = []
    for rank in range(world):
        left = rank * partition
        end.append(min(partition, max(0, left + partition - offset)))
    stored = tuple(partition - e for e in end)
    placed = zero12(group, shapes, paddings, stored, partition, lean=True)
    return FlatGroup(
        group, tuple(shapes), tuple(placed), partition, stored, tuple(paddings), tuple(end)
    )


def zero3_groups(
    group: int,
    first: int,
    shapes: Sequence[tuple[str, tuple[int, ...]]],
    world: int,
    sub_group_size: int | None,
) -> list[FlatGroup]:
    """Return param group ``group`` cut into ZeRO-3 sub-groups for ``world`` ranks, numbered from ``first``."""
    parts = [math.ceil(math.prod(shape) / world) for _, shape in shapes]
    subs: list[list[int]] = []
    if sub_group_size is None or sub_group_size >= sum(parts):
        subs = [list(range(len(shapes)))] if shapes else []
    else:
        current, size = [], 0
        for i, part in enumerate(parts):
            current.append(i)
            size += part
            if size >= sub_group_size or i == len(shapes) - 1:
                subs.append(current)
                current, size = [], 0
    out = []
    for k, members in enumerate(subs):
        sub_shapes = tuple(shapes[i] for i in members)
        size = sum(parts[i] for i in members)
        placed = zero3(first + k, sub_shapes, [size] * world)
        out.append(FlatGroup(group, sub_shapes, tuple(placed), size, (size,) * world))
    return out
