"""The conversion engine: frame DST, fill every region with the source's bytes, patch checksums.

One loop for every output format (``formats/*`` writers describe their files as regions,
``shardckpt.state.regions``). Call order (every rank runs every step; ``Runtime.agreed`` turns
a failure on one rank into the same error on all of them before the next collective);
``api.convert`` opens the staging path before and publishes it after:
  1) ``writer.frame(runtime)``: headers and skeletons are written, and each process
     learns the regions it fills: its rows of every tensor of a full file, or every
     region of the files of the target ranks it acts for (``shardckpt.formats.ranks.target_ranks``).
  2) per batch of at most ``plan.buffer_bytes`` (less the worker threads' slices,
     ``engine.workers``): read the rows that hold the batch's regions, ``pwrite`` each
     region's bytes at its offset, note its CRC-32, on the worker threads. Every rank
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

import os
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

from isal.isal_zlib import crc32_combine

from shardckpt.codecs.tensor_bytes import cast_bytes
from shardckpt.codecs.zip_skeleton import patch_crc, pwrite_all
from shardckpt.core import lazy_torch
from shardckpt.core.costs import Costs
from shardckpt.core.files import writing
from shardckpt.core.lazy_torch import torch
from shardckpt.engine.dst_files import DstFiles
from shardckpt.engine.jobs import JobQueue, blobs_of, regions_of
from shardckpt.engine.rows import read_regions
from shardckpt.engine.stored_copy import copy_runs, fetch_ahead, pieces_of, worth_copying
from shardckpt.engine.workers import Workers, default_threads, rows_budget, slice_bytes
from shardckpt.formats.base import Reader, StoredRun, Writer
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
    reader: Reader,
    plan,
    writer: Writer,
    runtime,
    progress,
    costs: Costs | None = None,
    threads: int | None = None,
) -> None:
    """Write ``plan``'s output under ``writer.root`` (the staging path the coordinator opened).

    ``threads``: the worker threads that move the bytes (``engine.workers``; None: the default).
    """
    costs = costs or Costs()
    with costs.phase("frame"):
        frame = writer.frame(runtime)
    metas = plan.metas
    threads = threads or default_threads()
    files = DstFiles(writer.root)
    # DST on object storage: the parts in flight come out of the one buffer too.
    buffer = plan.buffer_bytes - (files.stream[0].share(plan.buffer_bytes) if files.stream else 0)
    # The workers' slices come out of the one buffer: a step's rows get what they leave.
    budget = rows_budget(buffer, threads)
    # In source order, so that the rows of one tensor that go to several files (several
    # target ranks' shards) are read together, once.
    order = {m.key: i for i, (_, m) in enumerate(plan.tensors)}
    regions = sorted(frame.regions, key=lambda r: (order[r.key], r.start))
    work = batches(regions, metas, budget)
    if files.stream is not None and _any_rank(runtime, bool(frame.files)):
        # DST on object storage: file jobs' parts go as they are written, after the marker.
        runtime.agreed(lambda: files.stream[0].begin(runtime.coordinator))
    jobs = JobQueue(frame.files, files, budget)
    workers = Workers(threads)
    size = slice_bytes(buffer, threads)
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
                    lambda b=batch, m=mine: _fill(
                        reader, b, m, metas, files, runtime, costs, workers, size
                    )
                )
                pieces += done[0]
                progress(done[1] * runtime.world_size)
        # What was written may still be in the page cache: flushing it can take as long.
        with costs.phase("flush"):
            progress.begin(files.count, "flush to disk", unit="files")
            runtime.agreed(lambda: files.sync(progress))
    finally:
        workers.close()
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
    if runtime.world_size == 1:
        return flag
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
    reader: Reader,
    batch: list[Region],
    jobs,
    metas,
    files: DstFiles,
    runtime,
    costs: Costs,
    workers: Workers,
    size: int,
) -> tuple[list[Piece], int]:
    """Read the rows of a step's regions and jobs, write each region at its offset and each job in order.

    A region whose bytes lie in SRC as they are (``Reader.stored_runs``), in runs of a
    MiB or more on average, is copied from there (``stored_copy``) by the workers, in
    pieces (``stored_copy.pieces_of``), while this thread locates the next regions' chunks
    and reads the others through the reader; the workers then write those and take their
    CRC-32s. Returns the pieces written into zip records of files several processes
    share, and the tensor bytes written (what the progress bar counts).
    """
    batch = [r for r in batch if r.stop > r.start]
    # Each region's work: its pieces' futures, each a CRC-32 of bytes at an offset.
    work: dict[Region, list[tuple[int, Future[int]]]] = {}
    # Every chunk located before any is copied: a source that changes meanwhile is found
    # by the copies, whatever the number of threads.
    located = _located(reader, batch, metas)
    copied = set(located)
    try:
        for region, runs in located.items():
            fetch_ahead(runs)
            fd, path = _pinned(files, region.file, work, workers), files.path(region.file)
            work[region] = _copies(workers, runs, fd, region.offset, path, region.key, size)
        # A file job's blobs stored as they lie (a DCP chunk's rows, whole) are copied into
        # place when the job writes them (``JobWriter.write``), not read.
        blobs = [blob.region for _, segments in jobs for blob in blobs_of(segments)]
        stored = _located(reader, blobs, metas)
        asked = [r for r in batch if r not in copied]
        asked += [r for _, segments in jobs for r in regions_of(segments) if r not in stored]
        lookup, read = read_regions(reader, asked, metas, runtime)
        costs.read_bytes += read
        for region in batch:
            if region not in copied:
                fd = _pinned(files, region.file, work, workers)
                done = workers.submit(
                    _write_read, region, lookup, fd, files.path(region.file), metas
                )
                work[region] = [(written_nbytes(region, metas), done)]
        crcs = {region: _combined(parts, workers) for region, parts in work.items()}
    except BaseException:
        # Nothing of the step may still write into DST while the run is taken down.
        workers.drain(f for parts in work.values() for _, f in parts)
        raise
    finally:
        files.unpin()
    pieces_written = []
    moved = 0
    for region in batch:
        length = written_nbytes(region, metas)
        files.written(region.file, region.offset, length)
        costs.read_bytes += length if region in copied else 0
        costs.written_bytes += length
        moved += length
        if region.record is not None:
            record = region.record
            offset = region.offset - record.start
            pieces_written.append(Piece(record.file, record.start, offset, length, crcs[region]))

    def copy(runs, fd: int, offset: int, path: Path, key: str) -> int:
        fetch_ahead(runs)
        return _combined(_copies(workers, runs, fd, offset, path, key, size), workers)

    costs.read_bytes += sum(sum(r.length for r in runs) for runs in stored.values())
    for job, segments in jobs:
        before = job.written
        job.write(segments, lookup, stored, copy)
        costs.written_bytes += job.written - before
        moved += sum(nbytes(r, metas) for r in regions_of(segments))
    return pieces_written, moved


def _located(reader: Reader, regions: list[Region], metas) -> dict[Region, list[StoredRun]]:
    """Return those of ``regions`` whose bytes lie in SRC as they are to be written (``worth_copying``), with their runs.

    In a process without torch every such region is copied, however short its runs:
    a short run's open and copy cost microseconds, torch's import seconds.
    """
    return {
        region: runs
        for region in regions
        if region.cast is None
        and region.stop > region.start
        and (runs := reader.stored_runs(metas[region.key], region.start, region.stop)) is not None
        and (worth_copying(runs) or not lazy_torch.loaded())
    }


def _copies(
    workers: Workers, runs, fd: int, offset: int, path: Path, key: str, size: int
) -> list[tuple[int, Future[int]]]:
    """Give the workers ``runs`` to copy from byte ``offset`` of ``fd``, a piece each; return (length, CRC-32 to come) per piece."""
    return [
        (
            sum(r.length for r in part),
            workers.submit(copy_runs, part, fd, offset + at, path, key, size),
        )
        for at, part in pieces_of(runs)
    ]


def _pinned(files: DstFiles, file: str, work, workers: Workers) -> int:
    """Return a descriptor of DST's ``file`` that stays open while workers write through it.

    Past the descriptors DST may keep (a quarter of ``ulimit -n``), the work given out
    so far finishes first and its files are let go.
    """
    if files.crowded:
        _settle(work, workers)
        files.unpin()
    return files.pin(file)


def _settle(work, workers: Workers) -> None:
    """Wait until none of ``work`` runs (raising the first error any of it met)."""
    workers.results(f for parts in work.values() for _, f in parts)


def _combined(parts: list[tuple[int, Future[int]]], workers: Workers) -> int:
    """Return the CRC-32 of a region's pieces, each ``(length, its CRC-32)``, combined in order."""
    crc = 0
    for (length, _), part in zip(parts, workers.results(f for _, f in parts)):
        crc = crc32_combine(crc, part, length)
    return crc


def _write_read(region: Region, lookup, fd: int, path: Path, metas) -> int:
    """Write the bytes read for ``region`` at its offset of ``fd`` (file ``path``); return their CRC-32 (0 where no record needs it).

    A region written in another dtype (``Region.cast``) is cast here, a step's rows at a time.
    """
    data = lookup(region)
    if region.cast is not None and region.cast != metas[region.key].dtype:
        data = cast_bytes(data, metas[region.key].dtype, region.cast)
    with writing(path):
        pwrite_all(fd, data, region.offset)
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
