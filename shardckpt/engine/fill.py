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

import contextvars
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from shardckpt.codecs.tensor_bytes import cast_bytes
from shardckpt.codecs.zip_skeleton import patch_crc, pwrite_all
from shardckpt.core.costs import Costs
from shardckpt.core.files import writing
from shardckpt.engine.dst_files import DstFiles
from shardckpt.engine.jobs import JobQueue, regions_of
from shardckpt.engine.rows import read_regions
from shardckpt.engine.stored_copy import copy_runs, fetch_ahead, worth_copying
from shardckpt.formats.base import Reader, Writer
from shardckpt.state.regions import (
    Piece,
    Record,
    Region,
    batches,
    combine_crc,
    crc32,
    nbytes,
    written_nbytes,
)

Progress = Callable[[int], None]


def run(
    reader: Reader, plan, writer: Writer, runtime, progress, costs: Costs | None = None
) -> None:
    """Write ``plan``'s output under ``writer.root`` (the staging path the coordinator opened)."""
    costs = costs or Costs()
    with costs.phase("frame"):
        frame = writer.frame(runtime)
    metas = plan.metas
    # In source order, so that the rows of one tensor that go to several files (several
    # target ranks' shards) are read together, once.
    order = {m.key: i for i, (_, m) in enumerate(plan.tensors)}
    regions = sorted(frame.regions, key=lambda r: (order[r.key], r.start))
    work = batches(regions, metas, plan.buffer_bytes)
    files = DstFiles(writer.root)
    jobs = JobQueue(frame.files, files, plan.buffer_bytes)
    total = sum(nbytes(r, metas) for r in frame.regions) + jobs.data
    # Every rank's share is about the same: the bar counts this rank's, for all of them.
    progress.begin(total * runtime.world_size, "write")
    pieces: list[Piece] = list(frame.pieces)
    try:
        with costs.phase("write"):
            step = 0
            while True:
                batch = work[step] if step < len(work) else []
                step += 1
                mine = jobs.step(metas) if step > len(work) else []
                if not _any_rank(runtime, bool(batch) or bool(mine)):
                    break
                done = runtime.agreed(
                    lambda b=batch, m=mine: _fill(reader, b, m, metas, files, runtime, costs)
                )
                pieces += done[0]
                progress(done[1] * runtime.world_size)
        # What was written may still be in the page cache: flushing it can take as long.
        with costs.phase("flush"):
            progress.begin(files.count, "flush to disk", unit="files")
            runtime.agreed(lambda: files.sync(progress))
    finally:
        files.close()
    with costs.phase("finish"):
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


def _any_rank(runtime, flag: bool) -> bool:
    """Return whether ``flag`` holds on any rank: every rank runs a step while one has work."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int64)
    runtime.max_over_ranks(t)
    return bool(t.item())


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


def _fill(
    reader: Reader, batch: list[Region], jobs, metas, files: DstFiles, runtime, costs: Costs
) -> tuple[list[Piece], int]:
    """Read the rows of a step's regions and jobs, write each region at its offset and each job in order.

    A region whose bytes lie in SRC as they are (``Reader.stored_runs``), in runs of a
    MiB or more on average, is copied from there (``stored_copy``) on a thread of its
    own, while this one locates the next regions' chunks and reads the others through the reader: the copy is system calls
    and CRCs that let go of the GIL, the rest is Python. Returns the pieces written into
    zip records of files several processes share, and the tensor bytes written (what the
    progress bar counts).
    """
    batch = [r for r in batch if r.stop > r.start]
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardckpt-copy") as copier:
        copies: dict[Region, Future[int]] = {}
        for region in batch:
            runs = (
                None
                if region.cast is not None
                else reader.stored_runs(metas[region.key], region.start, region.stop)
            )
            if runs is not None and worth_copying(runs):
                if files.crowded:
                    # Each copy holds its DST file open: past the descriptors DST may
                    # keep (a quarter of ``ulimit -n``), the copies so far finish first.
                    for copy in copies.values():
                        copy.result()
                    files.unpin()
                fd, path = files.pin(region.file), files.path(region.file)
                # In this thread's context: the copy notes what it read in the command's ledger.
                run = contextvars.copy_context().run
                fetch_ahead(runs)
                copies[region] = copier.submit(
                    run, copy_runs, runs, fd, region.offset, path, region.key
                )
        asked = [r for r in batch if r not in copies]
        asked += [r for _, segments in jobs for r in regions_of(segments)]
        lookup, read = read_regions(reader, asked, metas, runtime)
        costs.read_bytes += read
        crcs = {r: _write_read(r, lookup, files, metas) for r in batch if r not in copies}
        crcs.update({r: copy.result() for r, copy in copies.items()})
        files.unpin()
    pieces = []
    moved = 0
    for region in batch:
        length = written_nbytes(region, metas)
        files.written(region.file, region.offset, length)
        costs.read_bytes += length if region in copies else 0
        costs.written_bytes += length
        moved += length
        if region.record is not None:
            record = region.record
            offset = region.offset - record.start
            pieces.append(Piece(record.file, record.start, offset, length, crcs[region]))
    for job, segments in jobs:
        before = job.written
        job.write(segments, lookup)
        costs.written_bytes += job.written - before
        moved += sum(nbytes(r, metas) for r in regions_of(segments))
    return pieces, moved


def _write_read(region: Region, lookup, files: DstFiles, metas) -> int:
    """Write the bytes read for ``region`` at its offset; return their CRC-32 (0 where no record needs it).

    A region written in another dtype (``Region.cast``) is cast here, a step's rows at a time.
    """
    data = lookup(region)
    if region.cast is not None and region.cast != metas[region.key].dtype:
        data = cast_bytes(data, metas[region.key].dtype, region.cast)
    with writing(files.path(region.file)):
        pwrite_all(files.fd(region.file), data, region.offset)
    return crc32(data) if region.record is not None else 0


def _patch_checksums(root: Path, gathered: list[tuple[list[Record], list[Piece]]]) -> None:
    """Write the CRC-32 of every record, combined from the pieces every rank wrote of it."""
    records = {(r.file, r.start): r for recs, _ in gathered for r in recs}
    by_record: dict[tuple[str, int], list[Piece]] = {k: [] for k in records}
    for _, pieces in gathered:
        for p in pieces:
            by_record[(p.file, p.record_start)].append(p)
    files = DstFiles(root)
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
