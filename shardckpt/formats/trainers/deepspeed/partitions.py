"""Where each parameter's elements lie in ZeRO's flat partitions (pure: no I/O).

ZeRO-1/2 (``DeepSpeedZeroOptimizer``, ``BF16_Optimizer``): per param group, the
parameters (in ``param_shapes`` order, each followed by its alignment padding) are one
flat tensor, padded at the end to a multiple of the world size and cut into equal
partitions, one per rank; so a parameter can start mid-row in one rank's partition and
end in the next one's. ZeRO-3: each parameter is cut on its own into ``ceil(numel / W)``
elements per rank (the last rank's padded), and a rank's partitions of the parameters of
one sub-group are concatenated in ``param_shapes`` order.

Both give, for each parameter, ``Piece``s: elements [start, start + numel) of the
parameter are at offset ``at`` of flat tensor ``flat`` of rank ``rank``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    """Elements [start, start + numel) of a parameter: at offset ``at`` of one rank's flat tensor."""

    rank: int
    flat: int
    """The flat tensor (ZeRO-1/2: param group; ZeRO-3: sub-group) of that rank."""
    at: int
    start: int
    numel: int


@dataclass(frozen=True)
class Placed:
    """One parameter of the flat partitions: its name, shape, flat tensor and pieces in element order."""

    fqn: str
    shape: tuple[int, ...]
    flat: int
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        """Return the number of elements of the parameter."""
        return math.prod(self.shape)


class LayoutError(ValueError):
    """The partitions' sizes do not hold the parameters their metadata lists (the message says how)."""


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def zero12(
    flat: int,
    shapes: Sequence[tuple[str, tuple[int, ...]]],
    paddings: Sequence[int],
    stored: Sequence[int],
    partition: int,
    lean: bool,
) -> list[Placed]:
    """Return the parameters of one ZeRO-1/2 param group, placed in its ranks' partitions.

    ``shapes`` are ``param_shapes`` of the group in flat order, ``paddings`` the alignment
    padding after each (``param_alignment_paddings``; zeros where not saved), ``stored``
    how many elements each rank's file holds, ``partition`` the partition size every
    rank's slice of the flat group has. ``lean``: the files hold their partitions without
    the padding at the end of the group (``DeepSpeedZeroOptimizer``), so together exactly
    the parameters; otherwise (``BF16_Optimizer``) each holds a whole partition.
    """
    if len(paddings) != len(shapes):
        raise LayoutError(
            f"group {flat} lists {len(shapes)} parameters but {len(paddings)} alignment paddings"
        )
    placed, offset = [], 0
    for (fqn, shape), padding in zip(shapes, paddings):
        n = _numel(shape)
        pieces = []
        for rank in range(offset // partition if partition else 0, len(stored)):
            lo, hi = max(offset, rank * partition), min(offset + n, (rank + 1) * partition)
            if lo >= hi:
                break
            at = lo - rank * partition
            if at + hi - lo > stored[rank]:
                raise LayoutError(
                    f"'{fqn}' needs elements up to {at + hi - lo} of rank {rank}'s partition of "
                    f"group {flat}, which holds {stored[rank]}"
                )
            pieces.append(Piece(rank, flat, at, lo - offset, hi - lo))
        if sum(p.numel for p in pieces) != n:
            raise LayoutError(
                f"'{fqn}' ends past the last partition of group {flat} ({len(stored)} ranks "
                f"of {partition} elements)"
            )
        placed.append(Placed(fqn, tuple(shape), flat, tuple(pieces)))
        offset += n + padding
    if lean and offset - (paddings[-1] if paddings else 0) != sum(stored):
        raise LayoutError(
            f"the parameters of group {flat} take {offset} elements, but the ranks' "
            f"partitions hold {sum(stored)} (param_shapes and partitions of different saves)"
        )
    return placed


def zero3(
    flat: int,
    shapes: Sequence[tuple[str, tuple[int, ...]]],
    stored: Sequence[int],
) -> list[Placed]:
    """Return the parameters of one ZeRO-3 sub-group, each cut into ``ceil(numel / W)`` per rank.

    ``stored`` is how many elements each rank's flat tensor of the sub-group holds.
    """
    world = len(stored)
    placed, offset = [], 0
    for fqn, shape in shapes:
        n = _numel(shape)
        part = math.ceil(n / world)
        pieces = tuple(
            Piece(rank, flat, offset, rank * part, min(part, n - rank * part))
            for rank in range(world)
            if n - rank * part > 0
        )
        placed.append(Placed(fqn, tuple(shape), flat, pieces))
        offset += part
    for rank, size in enumerate(stored):
        if size != offset:
            raise LayoutError(
                f"rank {rank}'s flat tensor of sub-group {flat} holds {size} elements, but its "
                f"parameters take {offset} ({world} ranks of ceil(numel / {world}) each)"
            )
    return placed


def check_fragments(placed: Sequence[Placed], fragments: Sequence[dict]) -> None:
    """Refuse a layout that disagrees with DeepSpeed's own ``param_slice_mappings``.

    ``fragments[rank]`` maps each FQN that has elements in that rank's partition of the
    group to ``(numel, start)``: where DeepSpeed put its slice. It checks the order and
    paddings the layout was computed from (round-robin reordering included).
    """
    for p in placed:
        for piece in p.pieces:
            got = fragments[piece.rank].get(p.fqn)
            if got != (piece.numel, piece.at):
                raise LayoutError(
                    f"'{p.fqn}' would be {piece.numel} elements at {piece.at} of rank "
                    f"{piece.rank}'s partition of group {p.flat}, but param_slice_mappings "
                    f"says {'nothing' if got is None else f'{got[0]} at {got[1]}'}"
                )
    for rank, mapping in enumerate(fragments):
        held = {p.fqn for p in placed for piece in p.pieces if piece.rank == rank}
        for fqn in mapping:
            if fqn not in held:
                raise LayoutError(
                    f"param_slice_mappings puts '{fqn}' in rank {rank}'s partition of group "
                    f"{placed[0].flat if placed else '?'}, where param_shapes does not"
                )
