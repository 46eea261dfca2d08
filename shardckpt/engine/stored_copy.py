"""Source bytes written as they lie: checked as they are read, written a slice at a time.

Where a region's bytes lie in SRC exactly as they are to be written
(``Reader.stored_runs``: a DCP chunk's rows, a safetensors tensor's elements, a
``torch.save`` tensor's in its storage's record, no cast),
reading them into a step's buffer
and writing them from it would hold a batch of them in user space. Here each run is read
a slice at a time into one small buffer (``pread``) and CRC'd there, and the slice then
reaches DST's file by the kernel's copy from SRC's page cache (``os.copy_file_range``,
the copy ``cp`` makes) or, into a filesystem held in memory and where the kernel cannot
copy between the two files, by ``pwrite`` from the buffer (``_write_slice`` says why).
The one CRC-32 serves twice: the source's check (noted in the command's ledger, as a
reader notes what it read) and the checksum of the record written (a safetensors
digest, a zip record's CRC-32).

SRC is read, never mapped: a file cut short while it is read (another process
truncating it) gives a short read, exit 3 naming the file, where a mapping faults
(SIGBUS) and kills the process with its partial output left behind. Reading costs little
more than mapping did: a 1 GiB DCP export to safetensors (16 tensors of 64 MiB, page cache
warm, 2 loaded cores) took 2.70-2.89 s wall (0.90-0.95 s system) against 2.58-2.78 s
(0.81-0.88 s) mapped."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

from isal import isal_zlib

from shardckpt.codecs.zip_skeleton import pwrite_all
from shardckpt.core.files import is_remote, open_source, read_exactly, will_read, writing
from shardckpt.core.libc import in_memory
from shardckpt.core.read_buffers import ReadBuffer
from shardckpt.formats.base import StoredRun
from shardckpt.state.checksums import active

SLICE = 4 << 20
"""Bytes CRC'd and then copied at a time: they are still in the CPU's cache when copied
(``engine.workers.slice_bytes`` makes it smaller where many threads share a small buffer)."""
PIECE = 16 << 20
"""Bytes of a region one worker thread copies (``pieces_of``): a 64 MiB tensor goes to four."""
MIN_RUN = 1 << 20
"""The fewest bytes a region's runs hold on average for it to be copied here.

Each run costs an open, a read and a copy call: for the few hundred bytes a chunk of
a 1,024-rank save holds, reading them (one ``pread`` into the step's buffer) costs less.
"""


def worth_copying(runs: Sequence[StoredRun]) -> bool:
    """Return whether ``runs`` are long enough, on average, to be copied here (``MIN_RUN``)."""
    return sum(run.length for run in runs) >= MIN_RUN * len(runs)


def fetch_ahead(runs: Sequence[StoredRun]) -> None:
    """Say that ``runs`` are copied next (as their copy is queued): a URL SRC's are fetched ahead, in order."""
    for run in runs:
        will_read(run.path, [(run.offset, run.length)])


def pieces_of(
    runs: Sequence[StoredRun], size: int | None = None
) -> Iterator[tuple[int, list[StoredRun]]]:
    """Yield ``runs`` cut into pieces of at most ``size`` bytes: (bytes before the piece, its runs).

    Each piece is copied on a worker of its own (``engine.workers``); their CRC-32s,
    combined in this order, are the CRC-32 of all the runs, however many threads copied them.
    """
    size = size or PIECE
    at, piece, held = 0, [], 0
    for run in runs:
        done = 0
        while done < run.length:
            take = min(run.length - done, size - held)
            piece.append(replace(run, offset=run.offset + done, length=take))
            done += take
            held += take
            if held == size:
                yield at, piece
                at, piece, held = at + held, [], 0
    if piece:
        yield at, piece


def copy_runs(
    runs: Sequence[StoredRun], fd: int, offset: int, dst: Path, key: str, size: int = SLICE
) -> int:
    """Write ``runs`` one after another from byte ``offset`` of ``fd`` (file ``dst``), ``size`` bytes at a time.

    Returns the CRC-32 of all the bytes written. Each run's bytes are noted in the
    active ledger against the source record they lie in (tensor ``key``'s).
    """
    ledger = active()
    buffer = slice_buffer(size)
    file_lock = _writing(fd)
    kernel = not in_memory(fd)
    crc = 0
    for run in runs:
        names = run_names(run, key)
        what = data_of(names)
        src_fd = open_source(run.path)
        try:
            by_kernel = kernel and not is_remote(src_fd)
            run_crc = 0
            with writing(dst):
                for at in range(0, run.length, size):
                    part = _read_slice(src_fd, buffer, run, at, what)
                    part_crc = isal_zlib.crc32(part)
                    run_crc = isal_zlib.crc32_combine(run_crc, part_crc, len(part))
                    with file_lock:
                        _write_slice(src_fd, part, run.offset + at, fd, offset + at, by_kernel)
                    if ledger is not None and run.written is not None:
                        ledger.expect(run.written, names)
                        where = run.offset + at - run.written.start
                        ledger.note(*run.written.key, where, part, part_crc)
        finally:
            os.close(src_fd)
        crc = isal_zlib.crc32_combine(crc, run_crc, run.length)
        offset += run.length
    return crc


def run_names(run: StoredRun, key: str) -> list[str]:
    """Return the tensors whose bytes ``run`` holds, as messages name them (tensor ``key``'s where it does not say)."""
    return [key] if run.names is None else list(run.names)


def data_of(names: Sequence[str]) -> str:
    """Return how an error names the bytes of ``names``: ``the data of 'w' and 'b'``."""
    return "the data of " + " and ".join(map(repr, names))


_THREAD = threading.local()


def slice_buffer(size: int, slot: int = 0) -> ReadBuffer:
    """Return this thread's slice buffer ``slot`` of ``size`` bytes: made once, not once per region (its pages faulted in once).

    ``diff`` compares two sides a slice at a time, one buffer (slot) for each.
    """
    buffers = getattr(_THREAD, "buffers", None)
    if buffers is None:
        buffers = _THREAD.buffers = {}
    buffer = buffers.get(slot)
    if buffer is None or buffer.size != size:
        buffer = buffers[slot] = ReadBuffer(size)
    return buffer


def _read_slice(src_fd: int, buffer: ReadBuffer, run: StoredRun, at: int, what: str) -> memoryview:
    """Read the slice of ``run`` from byte ``at`` into ``buffer``; return it, whole, or raise (exit 3).

    ``pread``, not a mapping: a source cut short while it is read gives a short read
    here, where touching a mapping past the file's new end kills the process (SIGBUS)
    with the partial output and the lock left behind.
    """
    part = buffer.for_read(run.offset + at, run.length - at)
    read_exactly(src_fd, part, run.offset + at, run.path, what)
    return part


def _write_slice(
    src_fd: int, part: memoryview, src_offset: int, fd: int, offset: int, by_kernel: bool
) -> None:
    """Write ``part`` (read from ``src_offset`` of ``src_fd``) at ``offset`` of ``fd``: by the kernel's copy where ``by_kernel`` and it can.

    Into a file held in memory (tmpfs) ``pwrite`` from the buffer costs less: a 4.3 GB
    export to /dev/shm took 3.9 CPU-s against 4.4 by the kernel's copy (six paired runs,
    each cheaper), the buffer still in the CPU's cache. Into ext4 the kernel's copy costs
    less (2.17 GB read, CRC'd and written: 1.37 against 2.41 CPU-s; ``scripts/bench_slices.py``,
    docs/benchmark.md "Into tmpfs: written from the buffer").
    """
    if by_kernel and _kernel_copy(src_fd, src_offset, fd, offset, len(part)):
        return
    # Written from what was read and CRC'd, over what the kernel copied before it stopped.
    pwrite_all(fd, part, offset)


_WRITERS: dict[tuple[int, int], threading.Lock] = {}
_WRITERS_LOCK = threading.Lock()


def _writing(fd: int) -> threading.Lock:
    """Return the lock held while a slice is written into the file open as ``fd`` (one per file).

    One thread at a time writes into one file: the kernel lets one writer in at a time
    anyway, and a thread that waits for its inode's lock there spins on the CPU (a full
    export at two threads spent a fifth of its CPU time spinning), where here it sleeps
    while another thread reads and CRCs. Looked up once per ``copy_runs``, not per slice.
    """
    info = os.fstat(fd)
    key = (info.st_dev, info.st_ino)
    with _WRITERS_LOCK:
        lock = _WRITERS.get(key)
        if lock is None:
            lock = _WRITERS[key] = threading.Lock()
        return lock


def _kernel_copy(src_fd: int, src_offset: int, fd: int, offset: int, length: int) -> bool:
    """Copy ``length`` bytes between the files in the kernel; False where it cannot (or the source ended)."""
    done = 0
    while done < length:
        try:
            n = os.copy_file_range(src_fd, fd, length - done, src_offset + done, offset + done)
        except OSError as exc:
            if exc.errno in _NO_KERNEL_COPY:
                return False
            raise
        if n == 0:
            return False
        done += n
    return True


_NO_KERNEL_COPY = frozenset({errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL})
"""What ``copy_file_range`` answers where it cannot copy between two files."""
