"""File jobs: per-rank files each written whole, front to back, by the process that frames them.

A job (``state.regions.FileJob``) is laid out only when the queue reaches it. Each step
takes the segments of one or more jobs until their regions reach the read buffer (a job
bigger than the buffer goes over several steps, a region bigger than it cut at row
boundaries); the step's regions are read at once (``rows.read_regions``), and each job's
bytes are put together in order and written at the end of the step. A region's bytes of a
MiB or more are written from the step's read buffer where they lie, not copied into the
job's own: the process holds one buffer of tensor data (``--buffer-size``), not two, and
nothing of a step's reads is held past it. Every zip record's CRC-32 is taken over the bytes as they are written and put
into its fields before those are written (or, for a field already written, right after):
no checksum is left to patch at the end, and nothing passes between ranks. A blob whose
bytes lie in SRC as they are to be written (a DCP chunk's rows, ``Reader.stored_runs``)
is not read at all: the workers copy it into place (``engine.stored_copy``), and the
CRC-32 their copy took goes into the blob's fields.
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from isal import isal_zlib

from shardckpt.codecs.zip_skeleton import pwrite_all
from shardckpt.core.files import writing
from shardckpt.engine.dst_files import DstFiles
from shardckpt.formats.base import StoredRun
from shardckpt.state.regions import Blob, FileJob, Record, Region, nbytes, row_elements
from shardckpt.state.tree import TensorMeta

# A step holds at most this many regions, so that a process writing many small files
# (a thousand target ranks' worth) holds a bounded number of them at a time.
STEP_REGIONS = 65536
WRITTEN_IN_PLACE = 1 << 20
"""Region bytes from this many on are written from the read buffer, not copied (a pwrite each)."""
COPIED = 32 << 20
"""A job writes out what it copied (headers, small regions) once it holds this many bytes of it."""


@dataclass(frozen=True, slots=True)
class _Open:
    """The bytes before a blob whose data goes in parts (larger than the buffer)."""

    blob: Blob


@dataclass(frozen=True, slots=True)
class _Close:
    """The bytes after such a blob: its CRC-32 is the parts' running one."""

    blob: Blob


@dataclass(frozen=True, slots=True)
class _InPlace:
    """Bytes already written where they go (a blob's data the workers copied): skipped, not written."""

    length: int


Segment = bytes | Region | Blob | _Open | _Close
Copy = Callable[[Sequence[StoredRun], int, int, Path, str], int]
"""Copies runs of SRC to an offset of a DST file (descriptor, offset, path, tensor); returns their CRC-32."""


def _blob_ends(blob: Blob, length: int, crc: int) -> tuple[bytearray, bytearray]:
    """Return ``blob``'s bytes before and after its ``length`` bytes of data, its CRC-32 fields ``crc``."""
    head, tail = bytearray(blob.head), bytearray(blob.tail)
    packed = struct.pack("<I", crc)
    for at in blob.crc_at:
        if at < len(head):
            head[at : at + 4] = packed
        else:
            at -= len(head) + length
            tail[at : at + 4] = packed
    return head, tail


class JobWriter:
    """One file job being written: where its layout stands, its output buffer, its checksums."""

    def __init__(self, job: FileJob, files: DstFiles, limit: int):
        self.job = job
        self.files = files
        self.limit = limit
        segments, records = job.layout()
        self._segments = iter(segments)
        self._records: deque[Record] = deque(records)
        self._pending: deque[Segment] = deque()
        self._fd: int | None = None
        """Created at the first write: a step hands out many small jobs, written one at a time."""
        # What is to be written next, in order: bytes copied here (bytearrays), views
        # of the step's read buffer (WRITTEN_IN_PLACE) and bytes copied into place (_InPlace).
        self._pieces: list[bytearray | memoryview | _InPlace] = []
        self._length = 0  # of the pieces
        self._copied = 0  # of the pieces, in bytearrays
        self._base = 0  # the file offset of the first piece's first byte
        self._crc = 0  # of the current record's bytes written so far
        self._crc_at = 0  # how far into the file the current record's CRC has reached
        self._patches: dict[int, bytes] = {}  # CRC fields not written yet, by offset
        self._running: int | None = None  # the CRC-32 of a blob whose data goes in parts
        self._blob_at = 0  # where that blob starts in the file
        self._blob_crc_at: tuple[int, ...] = ()  # its CRC-32 fields, from its start
        self.written = 0
        self.done = False

    def _next(self) -> Segment | None:
        if self._pending:
            return self._pending.popleft()
        return next(self._segments, None)

    def take(
        self, room: int, count: int, metas: Mapping[str, TensorMeta], must: bool
    ) -> tuple[list[Segment], int]:
        """Return this job's next segments whose regions hold at most ``room`` bytes and ``count`` regions.

        A region that does not fit is cut at a row boundary of its tensor (a read is of
        whole rows); with ``must`` (nothing taken yet this step), one row at least goes.
        A blob goes whole (its checksum is taken as it is written), or waits.
        """
        out: list[Segment] = []
        taken = 0
        while True:
            segment = self._next()
            if segment is None:
                self.done = True
                return out, taken
            if type(segment) in (bytes, _Open, _Close):
                out.append(segment)
                continue
            if len(out) >= count and taken:
                self._pending.appendleft(segment)
                return out, taken
            region = segment.region if type(segment) is Blob else segment
            size = nbytes(region, metas)
            fits = taken + size <= room
            if fits or type(segment) is Blob and must and not taken and size <= self.limit:
                out.append(segment)
                taken += size
                continue
            if type(segment) is Blob:
                if size <= self.limit and taken:
                    self._pending.appendleft(segment)  # whole, next step
                    return out, taken
                # Larger than the buffer: its data goes in parts, the checksum running on.
                self._pending.extendleft([_Close(segment), segment.region, _Open(segment)])
                continue
            meta = metas[segment.key]
            row = row_elements(meta) or 1
            cut = (segment.start + (room - taken) // meta.dtype.itemsize) // row * row
            if cut <= segment.start and must and not taken:
                cut = (segment.start // row + 1) * row
            if cut <= segment.start or not meta.shape:
                if must and not taken:
                    out.append(segment)  # a 0-dim tensor cannot be cut
                    taken += size
                    continue
                self._pending.appendleft(segment)
                return out, taken
            head, tail = _cut(segment, meta, min(cut, segment.stop))
            out.append(head)
            taken += nbytes(head, metas)
            if tail is not None:
                self._pending.appendleft(tail)
            return out, taken

    def write(
        self,
        segments: Sequence[Segment],
        lookup: Callable[[Region], memoryview],
        stored: Mapping[Region, Sequence[StoredRun]] | None = None,
        copy: Copy | None = None,
    ) -> None:
        """Write ``segments`` at the end of what this job wrote, with the source bytes ``lookup`` gives.

        A blob whose region ``stored`` holds is copied into place by ``copy`` instead.
        Everything is written before returning: the views of the step's reads go with it.
        """
        for segment in segments:
            kind = type(segment)
            if kind is bytes:
                self._put(segment, copy=True)
            elif kind is Blob and stored and segment.region in stored and copy is not None:
                runs = stored[segment.region]
                length = sum(run.length for run in runs)
                at = self._base + self._length + len(segment.head)
                crc = copy(
                    runs, self._open(), at, self.files.path(self.job.file), segment.region.key
                )
                head, tail = _blob_ends(segment, length, crc)
                self._put(head, copy=True)
                self._pieces.append(_InPlace(length))
                self._length += length
                self._put(tail, copy=True)
            elif kind is Blob:
                region = segment.region
                data = lookup(region) if region.stop > region.start else b""
                head, tail = _blob_ends(segment, len(data), isal_zlib.crc32(data))
                self._put(head, copy=True)
                self._put(data)
                self._put(tail, copy=True)
            elif kind is _Open:
                self._running, self._blob_at = 0, self._base + self._length
                self._blob_crc_at = segment.blob.crc_at
                self._put(segment.blob.head, copy=True)
            elif kind is _Close:
                self._put(segment.blob.tail, copy=True)
                # Its fields may lie in what is written already (a local header): patched after.
                packed = struct.pack("<I", self._running)
                for at in segment.blob.crc_at:
                    self._patches[self._blob_at + at] = packed
                self._running = None
            elif segment.stop > segment.start:
                data = lookup(segment)
                self._put(data)
                if self._running is not None:
                    self._running = isal_zlib.crc32(data, self._running)
            if self._copied >= COPIED:
                self._flush()
        self._flush()
        if self.done:
            self._finish()

    def _put(self, data, copy: bool = False) -> None:
        """Append ``data`` to what is to be written: copied, unless it is region bytes of a MiB or more."""
        if not data:
            return
        if not copy and len(data) >= WRITTEN_IN_PLACE:
            self._pieces.append(memoryview(data))
        else:
            if not self._pieces or type(self._pieces[-1]) is not bytearray:
                self._pieces.append(bytearray())
            self._pieces[-1] += data
            self._copied += len(data)
        self._length += len(data)

    def _spans(self, lo: int, hi: int) -> Iterator[memoryview]:
        """Yield the pieces' bytes from file offset ``lo`` to ``hi``, in order."""
        at = self._base
        for piece in self._pieces:
            end = at + _length(piece)
            if end > lo and at < hi:
                if type(piece) is _InPlace:
                    raise RuntimeError(
                        f"internal: a record of file job {self.job.file!r} holds bytes copied in place"
                    )
                yield memoryview(piece)[max(lo, at) - at : min(hi, end) - at]
            if end >= hi:
                return
            at = end

    def _flush(self) -> None:
        """Write the pieces out, with the CRC-32 of every record they complete put in place."""
        base = self._base
        end = base + self._length
        while self._records and self._records[0].start < end:
            record = self._records[0]
            stop = record.start + record.length
            lo, hi = max(record.start, self._crc_at), min(stop, end)
            for span in self._spans(lo, hi) if hi > lo else ():
                self._crc = isal_zlib.crc32(span, self._crc)
            self._crc_at = hi
            if hi < stop:
                break
            packed = struct.pack("<I", self._crc)
            for at in record.crc_at:
                self._patches[at] = packed
            self._records.popleft()
            self._crc, self._crc_at = 0, 0
        late = []
        for at in [a for a in self._patches if a < end]:
            packed = self._patches.pop(at)
            if at >= base:
                (field,) = self._spans(at, at + 4)  # in a header: copied, so writable
                field[:] = packed
            else:
                late.append((at, packed))
        path = self.files.path(self.job.file)
        fd = self._open()
        with writing(path):
            at = base
            for piece in self._pieces:
                if type(piece) is not _InPlace:
                    pwrite_all(fd, memoryview(piece), at)
                at += _length(piece)
            for at, packed in late:
                pwrite_all(fd, memoryview(packed), at)
        self.written += self._length
        self._base = end
        self._pieces, self._length, self._copied = [], 0, 0
        self.files.final(self.job.file, self._final())

    def _final(self) -> int:
        """Return how far the file's bytes are final: up to its first CRC-32 field still to be written.

        A record not complete yet (and a blob whose data goes in parts) has a CRC-32 field
        in its local header, before its data, written once its data is; records lie in
        file order. (DCP's ``torch.save`` items keep theirs after the data: nothing waits.)
        """
        upto = self._base
        if self._records and self._records[0].crc_at:
            upto = min(upto, *self._records[0].crc_at)
        if self._running is not None and self._blob_crc_at:
            upto = min(upto, *(self._blob_at + at for at in self._blob_crc_at))
        return upto

    def _open(self) -> int:
        """Return the job's file, created (empty) the first time."""
        if self._fd is None:
            self._fd = self.files.create(self.job.file)
        return self._fd

    def _finish(self) -> None:
        if self._records or self._patches:
            raise RuntimeError(
                f"internal: file job {self.job.file!r} ended before {len(self._records)} of its "
                "records (or their checksums) were written"
            )
        self.files.done(self.job.file)
        self.files.whole(self.job.file, self.written)


def _length(piece) -> int:
    """Return the bytes ``piece`` stands for in the file."""
    return piece.length if type(piece) is _InPlace else len(piece)


def blobs_of(segments: Sequence[Segment]) -> Iterator[Blob]:
    """Yield the blobs among ``segments``."""
    for segment in segments:
        if type(segment) is Blob:
            yield segment  # type: ignore[misc]


def regions_of(segments: Sequence[Segment]) -> Iterator[Region]:
    """Yield the regions ``segments`` read: each region's, and each blob's."""
    for segment in segments:
        kind = type(segment)
        if kind is Region:
            yield segment  # type: ignore[misc]
        elif kind is Blob:
            yield segment.region  # type: ignore[union-attr]


def _cut(region: Region, meta: TensorMeta, at: int) -> tuple[Region, Region | None]:
    """Return ``region`` cut before element ``at``: its head and its tail (None when empty)."""
    head = Region(region.key, region.start, at, region.file, region.offset, region.record)
    if at >= region.stop:
        return head, None
    offset = region.offset + (at - region.start) * meta.dtype.itemsize
    return head, Region(region.key, at, region.stop, region.file, offset, region.record)


class JobQueue:
    """This process's file jobs, handed out a step at a time."""

    def __init__(self, jobs: Sequence[FileJob], files: DstFiles, limit: int):
        self._jobs: Iterator[FileJob] = iter(jobs)
        self._current: JobWriter | None = None
        self.files = files
        self.limit = limit
        self.data = sum(j.data for j in jobs)

    @property
    def empty(self) -> bool:
        """Return whether every job was handed out whole."""
        if self._current is None:
            job = next(self._jobs, None)
            if job is None:
                return True
            self._current = JobWriter(job, self.files, self.limit)
        return False

    def step(self, metas: Mapping[str, TensorMeta]) -> list[tuple[JobWriter, list[Segment]]]:
        """Return the next step's work: jobs and their segments, whose regions hold at most the buffer."""
        out: list[tuple[JobWriter, list[Segment]]] = []
        room, count = self.limit, STEP_REGIONS
        while not self.empty:
            writer = self._current
            assert writer is not None
            segments, taken = writer.take(room, count, metas, must=room == self.limit)
            out.append((writer, segments))
            room -= taken
            count -= sum(1 for _ in regions_of(segments))
            if not writer.done:
                break  # the buffer is full: the job goes on next step
            self._current = None
        return out
