"""Every byte of a checkpoint read once, split over the ranks, each checksummed span CRC'd as it passes.

The files are laid end to end and cut into one contiguous share per rank, and each share
into one part per worker thread (``--threads``), so each reads about as much,
sequentially, through one buffer of ``BLOCK`` bytes of its own: memory
stays bounded whatever the files' sizes, and each block is still in the CPU's cache when
it is CRC'd (a larger buffer measured slower: the bytes went to memory and back).
``pread`` rather than a memory map: a disk that fails a read gives an error to report,
where a mapped page would end the process with SIGBUS. The bytes of a span that carries a checksum
go to the ledger as they pass (a span cut between two ranks' shares is chained again
by ``state.checksums.judge``); the other bytes are read only to find what cannot be
read (an I/O error, a file cut short since it was listed).
"""

from __future__ import annotations

import bisect
import os
import threading

from shardckpt.core.errors import BadInputError
from shardckpt.core.files import open_source, os_error, preadv, will_read
from shardckpt.core.read_buffers import ReadBuffer
from shardckpt.engine.workers import Workers, default_threads
from shardckpt.formats.file_checks import FileCheck
from shardckpt.state.checksums import Ledger

BLOCK = 1 << 20
"""Bytes read at a time: large enough for sequential reads at the disk's speed, small
enough to stay in cache until CRC'd."""


def share(sizes: list[int], world_size: int, rank: int) -> list[tuple[int, int, int]]:
    """Return rank ``rank``'s contiguous share of files of ``sizes`` laid end to end: (file, start, stop) pieces."""
    total = sum(sizes)
    lo, hi = total * rank // world_size, total * (rank + 1) // world_size
    out, at = [], 0
    for i, size in enumerate(sizes):
        a, b = max(lo, at), min(hi, at + size)
        if a < b:
            out.append((i, a - at, b - at))
        at += size
    return out


def scan(
    checks: list[FileCheck],
    ledger: Ledger,
    rank: int,
    world_size: int,
    progress,
    threads: int | None = None,
) -> int:
    """Read this rank's share of every file, noting each span's bytes in ``ledger``; return the bytes read.

    The share is cut again into one contiguous part per worker thread (``threads``; None:
    ``engine.workers.default_threads``), each read through a ``BLOCK`` of its own: the
    part of thread t is the share of rank ``rank * threads + t`` of ``world_size * threads``.
    """
    threads = threads or default_threads()
    sizes = [c.size for c in checks]
    workers = Workers(threads)
    lock = threading.Lock()

    def counted(n: int) -> None:
        with lock:
            progress(n)

    def part(t: int) -> int:
        buffer = ReadBuffer(BLOCK)
        done = 0
        for i, start, stop in share(sizes, world_size * threads, rank * threads + t):
            done += _read(checks[i], start, stop, ledger, buffer, counted, workers.stopping)
        return done

    try:
        return sum(workers.results(workers.submit(part, t) for t in range(threads)))
    finally:
        workers.close()


def _read(
    check: FileCheck,
    start: int,
    stop: int,
    ledger: Ledger,
    buffer: ReadBuffer,
    progress,
    stopping: threading.Event,
) -> int:
    """Read bytes [start, stop) of one file, noting the spans they overlap; give up once ``stopping`` is set."""
    spans = check.spans
    ends = [s.start + s.length for s in spans]
    first = bisect.bisect_right(ends, start)
    fd = open_source(check.path)
    will_read(check.path, [(start, stop - start)])
    try:
        os.posix_fadvise(fd, start, stop - start, os.POSIX_FADV_SEQUENTIAL)
        at = start
        while at < stop and not stopping.is_set():
            view = buffer.for_read(at, stop - at)
            n = preadv(fd, view, at)
            if n == 0:
                raise BadInputError(
                    f"truncated: it ends at byte {at}, where it had {check.size} bytes when listed",
                    path=check.path,
                    hint="the file changed while it was read; verify it again once nothing writes it",
                )
            first = _note(spans, first, at, view[:n], ledger)
            at += n
            progress(n)
    except OSError as exc:
        raise os_error(exc, check.path) from None
    finally:
        os.close(fd)
    return stop - start


def _note(spans, first: int, at: int, data: memoryview, ledger: Ledger) -> int:
    """Note ``data`` (read at byte ``at``) for each span it overlaps from ``spans[first]``; return the first span left open."""
    end = at + len(data)
    i = first
    while i < len(spans) and spans[i].start < end:
        span = spans[i]
        lo, hi = max(at, span.start), min(end, span.start + span.length)
        if lo < hi:
            ledger.note(span.file, span.start, lo - span.start, data[lo - at : hi - at])
        if span.start + span.length > end:
            break
        i += 1
    return i
