"""The conversion engine: frame DST, fill every region with the source's bytes, patch checksums.

One loop for every output format (``formats/*`` writers describe their files as regions,
``shardckpt.state.regions``). Call order (every rank runs every step; ``Runtime.agreed`` turns
a failure on one rank into the same error on all of them before the next collective);
``api.convert`` opens the staging path before and publishes it after:
  1) ``writer.frame(runtime)``: headers and skeletons are written, and each process
     learns the regions it fills: its rows of every tensor of a full file, or every
     region of the files of the target ranks it acts for (``shardckpt.formats.ranks.target_ranks``).
  2) per batch of at most ``plan.buffer_bytes``: read the rows that hold the batch's
     regions, ``pwrite`` each region's bytes at its offset, note its CRC-32. Every rank
     runs the same number of steps; a rank with fewer batches runs empty ones.
  3) each process flushes what it wrote to disk; the pieces of every zip record are
     gathered to the coordinator, which patches each record's CRC-32.
  4) (coordinator) ``writer.finish()``; where DST is on the nodes' own disks
     (``shardckpt.core.placement``), each process patches the checksums of its own files
     instead, and the files every copy needs (DCP's ``.metadata``) go to each disk.
No rank ever holds more than one batch of tensor data, and no data passes between ranks:
each rank reads what it writes; where SRC is not on one filesystem every rank sees,
the reader is an ``exchange.SharedReader``, whose reads bring rows from the ranks that
see their files.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

import torch

from shardckpt.codecs.tensor_bytes import contiguous_bytes
from shardckpt.codecs.zip_skeleton import patch_crc, pwrite_all
from shardckpt.core.files import writing
from shardckpt.formats.base import Reader, Writer
from shardckpt.state.regions import (
    Piece,
    Record,
    Region,
    batches,
    combine_crc,
    crc32,
    nbytes,
    row_elements,
    rows_of,
)

Progress = Callable[[int], None]


class _Files:
    """The DST files this process writes into, each opened once (they exist: framing made them)."""

    def __init__(self, root: Path):
        self.root = root
        self._fds: dict[str, int] = {}

    def path(self, file: str) -> Path:
        return self.root / file if file else self.root

    def fd(self, file: str) -> int:
        if file not in self._fds:
            with writing(self.path(file)):
                self._fds[file] = os.open(self.path(file), os.O_RDWR)
        return self._fds[file]

    @property
    def count(self) -> int:
        """Return how many files this process has opened."""
        return len(self._fds)

    def sync(self, progress: Progress = lambda n: None) -> None:
        """Flush every file written to disk (on a shared filesystem, each rank its own writes)."""
        for file, fd in self._fds.items():
            with writing(self.path(file)):
                os.fsync(fd)
            progress(1)

    def close(self) -> None:
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()


def run(reader: Reader, plan, writer: Writer, runtime, progress) -> None:
    """Write ``plan``'s output under ``writer.root`` (the staging path the coordinator opened)."""
    frame = writer.frame(runtime)
    metas = plan.metas
    # In source order, so that the rows of one tensor that go to several files (several
    # target ranks' shards) are read together, once.
    order = {m.key: i for i, (_, m) in enumerate(plan.tensors)}
    regions = sorted(frame.regions, key=lambda r: (order[r.key], r.start))
    work = batches(regions, metas, plan.buffer_bytes)
    steps = _most(runtime, len(work))
    progress.begin(sum(nbytes(r, metas) for r in frame.regions) * runtime.world_size, "write")
    files = _Files(writer.root)
    pieces: list[Piece] = list(frame.pieces)
    try:
        for i in range(steps):
            batch = work[i] if i < len(work) else []
            pieces += runtime.agreed(lambda b=batch: _fill(reader, b, metas, files, runtime))
            progress(sum(nbytes(r, metas) for r in batch) * runtime.world_size)
        # What was written may still be in the page cache: flushing it can take as long.
        progress.begin(files.count, "flush to disk", unit="files")
        runtime.agreed(lambda: files.sync(progress))
    finally:
        files.close()
    if writer.placement is not None and writer.placement.several:
        # DST on the nodes' own disks holds per-rank files only, each written whole by
        # the process that framed it: its checksums are patched where it lies.
        runtime.agreed(lambda: _patch_checksums(writer.root, [(frame.records, pieces)]))
    else:
        gathered = runtime.gather((frame.records, pieces))
        runtime.agreed(
            lambda: _patch_checksums(writer.root, gathered) if runtime.coordinator else None
        )
    runtime.agreed(lambda: writer.finish() if runtime.coordinator else None)
    _copy_to_every_disk(writer, runtime)


def _copy_to_every_disk(writer: Writer, runtime) -> None:
    """Give each other disk's DST the files the coordinator finished that every copy needs."""
    placement = writer.placement
    if placement is None or not placement.several or not writer.every_copy:
        return

    def read() -> dict[str, tuple[int, bytes]] | None:
        if not runtime.coordinator:
            return None
        # Each with its permission bits: a carried 0600 file stays 0600 on every disk.
        return {
            name: (os.stat(writer.root / name).st_mode & 0o777, (writer.root / name).read_bytes())
            for name in writer.every_copy
        }

    files = runtime.broadcast(runtime.agreed(read))

    def write() -> None:
        if runtime.coordinator or not placement.opener:
            return
        for name, (mode, data) in files.items():
            path = writer.root / name
            with writing(path):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())

    runtime.agreed(write)


def _most(runtime, count: int) -> int:
    """Return the largest ``count`` over every rank."""
    t = torch.tensor([count], dtype=torch.int64)
    runtime.max_over_ranks(t)
    return int(t.item())


def _fill(reader: Reader, batch: list[Region], metas, files: _Files, runtime) -> list[Piece]:
    """Read the rows that hold ``batch``'s regions and write each region at its offset."""
    batch = [r for r in batch if r.stop > r.start]
    read = _read_rows(reader, batch, metas, runtime)
    pieces = []
    for region in batch:
        meta = metas[region.key]
        first, tensor = read(region)
        flat = tensor.reshape(-1)[region.start - first : region.stop - first]
        data = contiguous_bytes(flat)
        if len(data) != nbytes(region, metas):
            raise RuntimeError(
                f"internal: read {len(data)} bytes of '{meta.key}' for a region of "
                f"{nbytes(region, metas)}"
            )
        fd = files.fd(region.file)
        with writing(files.path(region.file)):
            pwrite_all(fd, data, region.offset)
        if region.record is not None:
            record = region.record
            pieces.append(
                Piece(
                    record.file, record.start, region.offset - record.start, len(data), crc32(data)
                )
            )
    return pieces


def _read_rows(reader: Reader, batch: list[Region], metas, runtime):
    """Read the rows ``batch``'s regions lie in; return a lookup: region -> (first element, rows).

    Regions of one tensor whose rows touch or overlap are read once; rows of one tensor
    that lie apart (two target ranks' shards) are separate requests. One ``read_spans``
    call per step, on every rank, even with nothing to read: a reader whose reads are
    collectives (``exchange.SharedReader``) needs every rank in each.
    """
    spans: dict[str, list[list[int] | None]] = {}
    for region in batch:
        rows = rows_of(region, metas[region.key])
        known = spans.setdefault(region.key, [])
        if rows is None:
            known[:] = [None]
            continue
        for span in known:
            if span is not None and rows[0] <= span[1] and span[0] <= rows[1]:
                span[0], span[1] = min(span[0], rows[0]), max(span[1], rows[1])
                break
        else:
            known.append(list(rows))
    asked = [(key, k) for key, v in spans.items() for k in range(len(v))]
    requests = [
        (metas[key], None if spans[key][k] is None else tuple(spans[key][k])) for key, k in asked
    ]
    got = dict(zip(asked, reader.read_spans(requests, runtime)))

    def lookup(region: Region) -> tuple[int, torch.Tensor]:
        meta = metas[region.key]
        rows = rows_of(region, meta)
        for k, span in enumerate(spans[region.key]):
            if span is None:
                return 0, got[(region.key, k)]
            if span[0] <= rows[0] and rows[1] <= span[1]:
                return span[0] * row_elements(meta), got[(region.key, k)]
        raise RuntimeError(f"internal: no read holds a region of '{region.key}'")

    return lookup


def _patch_checksums(root: Path, gathered: list[tuple[list[Record], list[Piece]]]) -> None:
    """Write the CRC-32 of every record, combined from the pieces every rank wrote of it."""
    records = {(r.file, r.start): r for recs, _ in gathered for r in recs}
    by_record: dict[tuple[str, int], list[Piece]] = {k: [] for k in records}
    for _, pieces in gathered:
        for p in pieces:
            by_record[(p.file, p.record_start)].append(p)
    files = _Files(root)
    try:
        for key, record in records.items():
            fd = files.fd(record.file)

            def read_gap(offset: int, length: int, fd=fd, record=record) -> bytes:
                return os.pread(fd, length, record.start + offset)

            with writing(files.path(record.file)):
                patch_crc(fd, record, combine_crc(record, by_record[key], read_gap))
        files.sync()
    finally:
        files.close()
