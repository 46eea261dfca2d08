"""Target ranks' files of a local format made from one rendering per kind of rank.

Rank r's file of ``fsdp2-ranks`` at M is ``torch.save`` of its state dict: placeholders
whose shapes are r's rows of each tensor, on a mesh that pickles r's own rank. Ranks
that hold as many rows of every tensor, and whose rank is written with as many bytes,
have files that differ only where the mesh writes the rank, in their data and in the
CRC-32s of both. So the state dict is built and ``torch.save``'d once per such kind
(``RankTemplate``), and each rank's file is that template with its own rank written in
(``RankTemplate.job``): the rows it is filled with, and the checksums the engine takes
as it writes, are its own. Where the rank is written is found by rendering the
template twice, with two ranks of its width whose every byte differs; a template whose
renderings differ elsewhere, or otherwise, is not used (``None``): the writer renders
each rank's file itself, as before.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from isal import isal_zlib

from shardckpt.codecs.zip_skeleton import (
    SerializationId,
    Storages,
    named_record,
    pickle_record,
    serialization_id,
    storages_in_order,
    write_skeleton,
)
from shardckpt.formats.ranks.rank_file import Fills
from shardckpt.state.regions import FileJob, Record, Region, dim0_rows, row_elements
from shardckpt.state.tree import TensorMeta

Render = Callable[[int, int, Fills], dict]
"""``render(rows_rank, mesh_rank, fills)``: the state dict of placeholders with ``rows_rank``'s
shapes on a mesh of ``mesh_rank``, noting what fills each placeholder in ``fills``."""

# Two ranks of each width, whose renderings tell where the rank is written (their low
# bytes differ): the first two of the width.
_PROBES = {1: (0, 1), 2: (256, 257)}


def rank_width(rank: int) -> int:
    """Return how many bytes pickle writes ``rank`` in (``BININT1``, ``BININT2``), 0 beyond."""
    return 1 if rank < 256 else 2 if rank < 65536 else 0


@dataclass(frozen=True)
class _Hole:
    """One placeholder's fill in the template: a source tensor's elements at a byte of the file."""

    meta: TensorMeta
    split: bool
    """Whether the elements are the rank's rows (else the whole tensor)."""
    at: int
    record: Record
    row: int
    """Elements per dim-0 row (``row_elements``), taken once: asked for every target rank."""

    def elements(self, rank: int, world_size: int) -> tuple[int, int]:
        """Return the elements [start, stop) of the source tensor that fill this hole on ``rank``."""
        if not self.split:
            return 0, self.meta.numel
        first, stop = dim0_rows(self.meta.shape, world_size, rank)  # type: ignore[misc]
        return first * self.row, stop * self.row


@dataclass(frozen=True)
class RankTemplate:
    """A file of one kind of target rank: its bytes, where its rank is written, what fills it."""

    data: bytes
    """The file, with the template's rank written in and zeros where the source's bytes go."""
    rank_at: tuple[int, ...]
    """Where the rank's own bytes start (each ``width`` bytes, little-endian)."""
    width: int
    holes: tuple[_Hole, ...]
    """What fills the file, by offset."""
    records: tuple[Record, ...]
    """``data.pkl``, every storage record and the serialization id, by offset: their CRC-32s are
    taken as written."""
    pickle: Record
    """The template's ``data.pkl``, where its rank is written."""
    ident: SerializationId | None
    """How ``torch.save``'s serialization id follows from ``data.pkl``'s CRC-32 (None: no id)."""

    def job(self, file: str, rank: int, world_size: int) -> FileJob:
        """Return target rank ``rank``'s file as a file job: the template with ``rank`` written in."""
        moved = 0
        for hole in self.holes:
            start, end = hole.elements(rank, world_size)
            moved += (end - start) * hole.meta.dtype.itemsize

        def layout() -> tuple[list, tuple[Record, ...]]:
            data = bytearray(self.data)
            value = rank.to_bytes(self.width, "little")
            for at in self.rank_at:
                data[at : at + self.width] = value
            if self.rank_at and self.ident is not None:
                pickle = self.pickle
                crc = isal_zlib.crc32(memoryview(data)[pickle.start : pickle.start + pickle.length])
                data[self.ident.at : self.ident.at + 20] = self.ident.digits(crc)
            out: list = []
            done = 0
            for hole in self.holes:
                start, end = hole.elements(rank, world_size)
                if end <= start:
                    continue
                if hole.at > done:
                    out.append(bytes(data[done : hole.at]))
                out.append(Region(hole.meta.key, start, end, file, hole.at, hole.record))
                done = hole.at + (end - start) * hole.meta.dtype.itemsize
            if done < len(data):
                out.append(bytes(data[done:]))
            return out, self.records

        return FileJob(file, moved, layout)


def own_file(render: Render, rank: int, metas, split: Callable[[TensorMeta], bool]) -> RankTemplate:
    """Return ``rank``'s own file as a template of one rank (nothing to write in)."""
    data, holes, records, ident, _ = _rendered(render, rank, rank)
    return _template(data, (), 1, holes, records, ident, metas, split)


def _template(data, rank_at, width, holes, records, ident, metas, split) -> RankTemplate:
    return RankTemplate(
        data,
        rank_at,
        width,
        tuple(
            _Hole(metas[key], split(metas[key]), at, record, row_elements(metas[key]))
            for key, at, record in sorted(holes, key=lambda h: h[1])
        ),
        tuple(sorted(records, key=lambda r: r.start)),
        records[0],
        ident,
    )


def rank_template(
    render: Render,
    rows_rank: int,
    width: int,
    world_size: int,
    metas,
    split: Callable[[TensorMeta], bool],
) -> RankTemplate | None:
    """Return the template of the ranks holding ``rows_rank``'s rows whose rank takes ``width`` bytes.

    ``metas`` are the plan's tensors by key; ``split(meta)`` says whether a tensor's
    placeholder is the rank's rows (else the whole tensor). None when the two renderings
    (the first two ranks of the width, of ``world_size``) differ in more than the rank's
    low bytes, each of them the start of the rank's bytes, and the checksums.
    """
    if width not in _PROBES or _PROBES[width][1] >= world_size:
        return None  # too few ranks to tell: each renders its own
    data, holes, records, ident, storages = _rendered(render, rows_rank, _PROBES[width][0])
    # The second rendering holds the same storages in the same order: only its bytes are needed.
    other, other_ident = _rendered_bytes(render, rows_rank, _PROBES[width][1], storages)
    if len(data) != len(other) or len({key for key, _, _ in holes}) != len(holes):
        return None
    if (ident is None) != (other_ident is None) or ident and ident.at != other_ident.at:
        return None
    pickle = records[0]
    # The checksums, and the serialization id made from them, differ too.
    derived = {at + k for r in records for at in r.crc_at for k in range(4)}
    if ident is not None:
        derived |= set(range(ident.at, ident.at + 20))
    rank_at = tuple(i for i in _differing(data, other) if i not in derived)
    probes = [p.to_bytes(width, "little") for p in _PROBES[width]]
    if not rank_at:
        return None
    for at in rank_at:
        if not pickle.start <= at <= pickle.start + pickle.length - width:
            return None
        if data[at : at + width] != probes[0] or other[at : at + width] != probes[1]:
            return None
    return _template(data, rank_at, width, holes, records, ident, metas, split)


def _differing(data: bytes, other: bytes, block: int = 4096) -> Iterator[int]:
    """Yield the positions where ``data`` and ``other`` (of one length) differ, block by block."""
    for start in range(0, len(data), block):
        if data[start : start + block] != other[start : start + block]:
            stop = min(start + block, len(data))
            yield from (i for i in range(start, stop) if data[i] != other[i])


def _rendered_bytes(
    render: Render, rows_rank: int, mesh_rank: int, storages: Storages
) -> tuple[bytes, SerializationId | None]:
    """Return one rendering's ``torch.save`` skeleton and how its serialization id is made."""
    state_dict = render(rows_rank, mesh_rank, {})
    with tempfile.TemporaryFile() as f:
        fd = f.fileno()
        write_skeleton(fd, 0, state_dict, "", storages)
        size = os.fstat(fd).st_size
        return os.pread(fd, size, 0), serialization_id(fd, 0, size)


def _rendered(
    render: Render, rows_rank: int, mesh_rank: int
) -> tuple[bytes, list[tuple[str, int, Record]], list[Record], SerializationId | None, Storages]:
    """Return one rendering's ``torch.save`` skeleton, its fills, its records (``data.pkl`` first,
    the serialization id's last), how its serialization id is made and its storages in order."""
    fills: Fills = {}
    state_dict = render(rows_rank, mesh_rank, fills)
    storages = storages_in_order(state_dict)
    with tempfile.TemporaryFile() as f:
        fd = f.fileno()
        placeholders, records, _ = write_skeleton(fd, 0, state_dict, "", storages)
        size = os.fstat(fd).st_size
        data = os.pread(fd, size, 0)
        pickle = pickle_record(fd, 0, size, "")
        ident = serialization_id(fd, 0, size)
        named = named_record(fd, 0, size, ".data/serialization_id", "")
    holes = []
    for storage, entries in fills.items():
        for key, start, stop, at in entries:
            # An empty placeholder has no bytes to fill, and may not be saved at all.
            if stop > start:
                record = placeholders[storage]
                holes.append((key, record.start + at, record))
    extra = [named] if named is not None else []
    return data, holes, [pickle, *records, *extra], ident, storages
