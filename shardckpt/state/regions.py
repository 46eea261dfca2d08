"""Where each byte of DST comes from: regions of source tensors at offsets of DST files (pure).

Every output format is laid out from the plan before any data moves (``formats/*``
writers' ``frame``): its files get their headers or ``torch.save`` skeletons, and what
is left is a list of ``Region``s, each "elements [start, stop) of source tensor ``key``
go to byte ``offset`` of file ``file``". Any process can fill any region, so a full
file is filled by every rank at once and each rank fills the files of the target ranks
it acts for. A region inside a zip record (``torch.save`` files, DCP data files) names
its ``Record``: the record's CRC-32 is combined from the pieces the ranks wrote
(``combine_crc``) and patched in at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from math import prod

from isal import isal_zlib

from shardckpt.core.lazy_torch import loaded, torch
from shardckpt.state.tree import TensorMeta


@dataclass(frozen=True, slots=True)
class Record:
    """A zip record of DST file ``file``: bytes [start, start + length), its CRC-32 kept at ``crc_at``."""

    file: str
    start: int
    length: int
    crc_at: tuple[int, ...]
    """Byte positions in ``file`` of the record's CRC-32 fields (local header, central directory)."""
    as_text: bool = False
    """The CRC-32 is written as 8 lowercase hex digits (a digest in a safetensors header),
    not as a zip's 4 little-endian bytes."""


@dataclass(frozen=True, slots=True)
class Region:
    """Elements [start, stop) of source tensor ``key`` (row-major) at byte ``offset`` of ``file``."""

    key: str
    start: int
    stop: int
    file: str
    """Relative to DST's staging path; ``""`` is that path itself (a one-file DST)."""
    offset: int
    record: Record | None = None
    """The zip record the bytes belong to, or None (safetensors: no checksum)."""
    cast: torch.dtype | None = None
    """The dtype the elements are written in, where not the source tensor's: cast as they
    are written (DeepSpeed's 16-bit module weights beside the fp32 master of the same
    tensor, ``formats/trainers/deepspeed/writer.py``)."""


@dataclass(frozen=True, slots=True)
class Piece:
    """What one process wrote of a record: ``length`` bytes at ``offset`` into it, and their CRC-32."""

    file: str
    record_start: int
    offset: int
    length: int
    crc: int


@dataclass(frozen=True, slots=True)
class Blob:
    """A zip record whose data is one region: the bytes before it, the region, the bytes after it.

    The bytes around it hold the record's CRC-32 fields (``torch.save``'s data
    descriptor and central directory entry after it, or its local header before it),
    filled in as the region's bytes are written: DCP's one-tensor ``torch.save`` items
    are such records.
    """

    head: bytes
    region: Region
    tail: bytes
    crc_at: tuple[int, ...]
    """Where the record's CRC-32 fields lie, from the first byte of ``head``."""


@dataclass(frozen=True)
class FileJob:
    """A DST file one process writes whole, front to back: bytes known from the plan, and regions.

    Laid out only when the engine reaches it (``layout``), so a process writing a
    thousand target ranks' files holds one file's layout at a time, not all of them.
    """

    file: str
    """Relative to DST's staging path (the job's regions and records are placed by it alone)."""
    data: int
    """The bytes of its regions: what filling it takes of the read buffer."""
    layout: Callable[[], tuple[Iterable[bytes | Region | Blob], Sequence[Record]]]
    """The file from its first byte to its last (literal bytes, regions and blobs, in
    order), and the other zip records in it (by offset), whose CRC-32 is taken over the
    bytes as they are written."""


def dim0_rows(shape: tuple[int, ...], world_size: int, rank: int) -> tuple[int, int] | None:
    """Return the dim-0 rows rank ``rank`` holds under ``Shard(0)`` over ``world_size`` ranks.

    torch's own rule (``Shard.local_shard_size_and_offset``, as ``fully_shard`` and
    DTensor split dim 0), remainders and empty ranks included; None for a 0-dim tensor.
    """
    if not shape:
        return None
    return _rows(shape[0], world_size, rank)


# torch's rule costs tens of µs a call (symbolic-shape helpers); a rank file's layout asks
# it once per (target rank x tensor), over a few distinct row counts: millions of calls at
# M = 1,024 for a handful of answers.
@lru_cache(maxsize=1 << 16)
def _rows(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    if not loaded():
        return chunk_rows(rows, world_size, rank)
    from torch.distributed.tensor import Shard

    size, offset = Shard.local_shard_size_and_offset(rows, world_size, rank)
    return (int(offset), int(offset) + int(size))


def chunk_rows(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """Return ``Shard(0)``'s rows of ``rank`` as ``torch.chunk`` cuts them, computed without torch.

    What a command that reads metadata only (``inspect``, ``verify``) uses where torch is
    not loaded; a test holds it to torch's own rule.
    """
    full = -(-rows // world_size)
    start = min(rows, full * rank)
    return (start, min(rows, start + full))


@dataclass(frozen=True)
class Split:
    """A tensor's ``Shard(0)`` rows over M ranks: ranks [0, empty_from) hold rows, the others none."""

    rows: int
    world_size: int

    @cached_property
    def spans(self) -> tuple[tuple[int, int], ...]:
        """Return each rank's (first row, row count), as torch's ``Shard(0)`` gives them."""
        out = []
        for rank in range(self.world_size):
            first, stop = dim0_rows((self.rows,), self.world_size, rank)  # type: ignore[misc]
            out.append((first, stop - first))
        return tuple(out)

    @cached_property
    def empty_from(self) -> int:
        """Return the first rank that holds no row (``world_size`` when every rank holds some).

        Every rank after it holds none either (``Shard(0)`` gives the rows in order).
        """
        counts = [n for _, n in self.spans]
        first = next((r for r, n in enumerate(counts) if n == 0), self.world_size)
        if any(counts[first:]):
            raise RuntimeError(f"internal: Shard(0) of {self.rows} rows leaves a gap")
        return first


def nbytes(region: Region, metas: dict[str, TensorMeta]) -> int:
    """Return the bytes of source rows ``region`` covers."""
    return (region.stop - region.start) * metas[region.key].dtype.itemsize


def written_nbytes(region: Region, metas: dict[str, TensorMeta]) -> int:
    """Return the bytes ``region`` takes in its file (``nbytes``, in the dtype it is cast to)."""
    return (region.stop - region.start) * (region.cast or metas[region.key].dtype).itemsize


def whole(meta: TensorMeta, file: str, offset: int, record: Record | None = None) -> Region:
    """Return the region that puts all of ``meta`` at ``offset`` of ``file``."""
    return Region(meta.key, 0, meta.numel, file, offset, record)


def row_elements(meta: TensorMeta) -> int:
    """Return the elements of one dim-0 row of ``meta`` (1 for a 0-dim tensor)."""
    return prod(meta.shape[1:]) if meta.shape else 1


def rows_of(region: Region, meta: TensorMeta) -> tuple[int, int] | None:
    """Return the dim-0 rows that hold ``region``'s elements (None: the whole 0-dim tensor)."""
    if not meta.shape:
        return None
    row = row_elements(meta)
    if row == 0:
        return (0, meta.shape[0])
    return (region.start // row, -(-region.stop // row))


def spread(
    regions: Sequence[Region], metas: dict[str, TensorMeta], rank: int, world_size: int
) -> list[Region]:
    """Return the part of ``regions`` process ``rank`` of ``world_size`` fills: its rows of each.

    Rows are split as ``Shard(0)`` splits them, so each process reads what it would hold
    in training; a 0-dim tensor goes to one process, in turn. The split divides the work
    of filling files every process writes, not a layout DST holds, so it is computed by
    ``chunk_rows`` (held to torch's rule by a test): asking torch's imported DTensor and
    sympy, 1.7 s of a 2-rank full export's start here.
    """
    out = []
    for i, region in enumerate(regions):
        meta = metas[region.key]
        if world_size == 1:
            out.append(region)
        elif not meta.shape:
            if i % world_size == rank:
                out.append(region)
        else:
            a, b = chunk_rows(meta.shape[0], world_size, rank)
            part = _clip(region, meta, a * row_elements(meta), b * row_elements(meta))
            if part is not None:
                out.append(part)
    return out


def _clip(region: Region, meta: TensorMeta, start: int, stop: int) -> Region | None:
    """Return the part of ``region`` within elements [start, stop), or None when empty."""
    a, b = max(region.start, start), min(region.stop, stop)
    if a >= b:
        return None
    offset = region.offset + (a - region.start) * (region.cast or meta.dtype).itemsize
    return Region(region.key, a, b, region.file, offset, region.record, region.cast)


def batches(
    regions: Sequence[Region], metas: dict[str, TensorMeta], limit: int
) -> list[list[Region]]:
    """Return ``regions`` in groups of at most ``limit`` bytes, splitting big ones at row boundaries.

    A single row bigger than ``limit`` still goes, alone: a row is the least a reader reads.
    """
    out: list[list[Region]] = []
    size = limit
    for part in _split(regions, metas, limit):
        part_bytes = nbytes(part, metas)
        if size + part_bytes > limit or not out:
            out.append([])
            size = 0
        out[-1].append(part)
        size += part_bytes
    return out


def _split(regions: Sequence[Region], metas: dict[str, TensorMeta], limit: int) -> Iterator[Region]:
    for region in regions:
        meta = metas[region.key]
        step = max(1, limit // max(1, row_elements(meta) * meta.dtype.itemsize)) * row_elements(
            meta
        )
        if nbytes(region, metas) <= limit or not meta.shape:
            yield region
            continue
        # Cut at row boundaries of the tensor, so each part reads whole rows.
        cut = region.start - region.start % row_elements(meta)
        while cut < region.stop:
            part = _clip(region, meta, cut, cut + step)
            if part is not None:
                yield part
            cut += step


def crc32(data) -> int:
    """Return the CRC-32 (zip's) of ``data``."""
    return isal_zlib.crc32(data)


def combine_crc(record: Record, pieces: Sequence[Piece], read_gap) -> int:
    """Return ``record``'s CRC-32 from ``pieces`` in any order; bytes no piece wrote come from ``read_gap(offset, length)``."""
    crc, at = 0, 0
    for piece in sorted(pieces, key=lambda p: p.offset):
        if piece.offset < at:
            raise RuntimeError(
                f"internal: two writes overlap in record at {record.start} of {record.file!r}"
            )
        if piece.offset > at:
            gap = piece.offset - at
            crc = isal_zlib.crc32_combine(crc, crc32(read_gap(at, gap)), gap)
        crc = isal_zlib.crc32_combine(crc, piece.crc, piece.length)
        at = piece.offset + piece.length
    if at < record.length:
        gap = record.length - at
        crc = isal_zlib.crc32_combine(crc, crc32(read_gap(at, gap)), gap)
    elif at > record.length:
        raise RuntimeError(
            f"internal: a write runs past the record at {record.start} of {record.file!r}"
        )
    return crc
