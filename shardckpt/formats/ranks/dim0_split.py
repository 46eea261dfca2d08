"""Layout labels of stored chunks, and the world size a dim-0 split was made for (pure).

DTensor/FSDP2 split dim 0 of n rows over N ranks into chunks of ``ceil(n / N)`` rows;
ranks past the end hold nothing, and DCP stores no data for them (at most one empty
chunk at offset n). So the chunks alone say N only within a range: every N with
``ceil(n / N)`` equal to the chunk size. Intersecting the ranges of every tensor of a
checkpoint, and the ranks its files name, usually pins N; where it does not, the label
says ``over ≥N`` with the smallest N consistent with everything.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from shardckpt.core.words import counted
from shardckpt.state.regions import chunk_rows
from shardckpt.state.tree import Chunk


@dataclass(frozen=True, slots=True)
class WorldSizes:
    """The world sizes a split is consistent with: ``low`` to ``high`` (None: no upper bound)."""

    low: int
    high: int | None

    def __and__(self, other: WorldSizes) -> WorldSizes | None:
        low = max(self.low, other.low)
        highs = [h for h in (self.high, other.high) if h is not None]
        high = min(highs) if highs else None
        return None if high is not None and high < low else WorldSizes(low, high)

    @property
    def pinned(self) -> int | None:
        """Return the one world size, when only one is consistent."""
        return self.low if self.low == self.high else None

    def label(self) -> str:
        """Return ``32``, or ``≥31`` where more than one world size is consistent."""
        return str(self.low) if self.pinned else f"≥{self.low}"


def dim0_rows(shape: tuple[int, ...], chunks: Sequence[Chunk]) -> list[tuple[int, int]] | None:
    """Return the non-empty ``(offset, rows)`` of chunks that split dim 0 only, else None."""
    if not shape or not all(
        all(o == 0 for o in c.offsets[1:]) and tuple(c.sizes[1:]) == tuple(shape[1:])
        for c in chunks
    ):
        return None
    return sorted((c.offsets[0], c.sizes[0]) for c in chunks if c.sizes[0] > 0)


def torch_split(n: int, world_size: int) -> list[tuple[int, int]]:
    """Return the non-empty ``(offset, rows)`` that ``Shard(0)`` gives ``n`` rows over ``world_size``.

    By ``chunk_rows``, torch's rule computed without it (a test holds the two equal): the
    world size a source was saved at is read from its metadata alike with torch loaded or
    not, and a conversion that only reads (a full export) need not import DTensor for it.
    """
    spans = (chunk_rows(n, world_size, r) for r in range(world_size))
    return sorted((start, stop - start) for start, stop in spans if stop > start)


def consistent_world_sizes(n: int, rows: list[tuple[int, int]], empty: bool) -> WorldSizes | None:
    """Return the world sizes whose ``Shard(0)`` split of ``n`` rows gives ``rows``, or None.

    ``empty``: an empty chunk was stored too, so some rank held nothing (N > len(rows)).
    """
    if not rows or n <= 0:
        return None
    size = rows[0][1]
    low = -(-n // size)
    high = None if size == 1 else -(-n // (size - 1)) - 1
    if high is not None and high < low or torch_split(n, low) != rows:
        return None
    if high is not None and torch_split(n, high) != rows:
        return None
    at_least = len(rows) + 1 if empty else len(rows)
    return WorldSizes(low, high) & WorldSizes(at_least, None)


def infer_world_sizes(
    tensors: Iterable[tuple[tuple[int, ...], Sequence[Chunk]]], at_least: int = 1
) -> WorldSizes | None:
    """Return the world sizes of at least ``at_least`` every dim-0 split of ``tensors`` fits.

    None when there is no split to tell from, or when the splits disagree (then they
    are no ``Shard(0)`` over one world size: HSDP, FSDP+TP).
    """
    common: WorldSizes | None = WorldSizes(at_least, None)
    found = False
    for shape, chunks in tensors:
        rows = dim0_rows(shape, chunks)
        if rows is None or (len(rows) < 2 and len(rows) == len(chunks)):
            continue
        fits = consistent_world_sizes(shape[0], rows, len(rows) < len(chunks))
        if fits is None:
            return None
        common = common & fits if common is not None else None
        found = True
    return common if found else None


def describe_chunks(
    shape: tuple[int, ...], chunks: Sequence[Chunk], world: int | WorldSizes | None
) -> str:
    """Return a layout label such as ``full``, ``Shard(0) over 4``, ``Shard(0) over ≥31`` or ``6 chunks``."""
    real = [c for c in chunks if all(s > 0 for s in c.sizes)] or list(chunks)
    whole = len(real) == 1 and tuple(real[0].sizes) == tuple(shape)
    rows = dim0_rows(shape, chunks)
    if rows is None:
        return "full" if whole else counted(len(real), "chunk")
    if isinstance(world, int):
        world = WorldSizes(world, world)
    # A stored empty chunk says some rank held none of it: split, even if one rank has it all.
    if world is not None and (len(chunks) > 1 or not whole):
        ends = {world.low, world.high or world.low}
        if all(torch_split(shape[0], n) == rows for n in ends):
            return f"Shard(0) over {world.label()}"
    return "full" if whole else f"Shard(0) in {len(rows)} chunks"
