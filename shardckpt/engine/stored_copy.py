"""Source bytes written as they lie: checked from a mapping, copied by the kernel.

Where a region's bytes lie in SRC exactly as they are to be written
(``Reader.stored_runs``: a DCP chunk's rows, no cast), reading them into a buffer and
writing them from it would copy every byte into user space and out again. Here each run
is mapped (``mmap``, populated in one call) and CRC'd a slice at a time, and
``os.copy_file_range`` then copies that slice from SRC's page cache into DST's file: the
copy ``cp`` makes, in the kernel. The bytes copied are the page-cache pages just CRC'd,
and the one CRC-32 serves twice: the source's check (noted in the command's ledger, as a
reader notes what it read) and the checksum of the record written (a safetensors digest,
a zip record's CRC-32). Where the kernel cannot copy between the two files (another
filesystem on an older kernel, a filesystem without it), the slice is ``pwrite``n from
the mapping instead. For 2.2 GB on the 2-core box (one run each, load 4):
copy_file_range 1.9-2.2 s CPU, 3.9-5.9 s wall; pwrite from the mapping 3.1-5.6 s CPU,
8.4-12.3 s wall.
"""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from isal import isal_zlib

from shardckpt.codecs.zip_skeleton import pwrite_all
from shardckpt.core.files import open_source, os_error, writing
from shardckpt.formats.base import StoredRun
from shardckpt.state.checksums import active

SLICE = 4 << 20
"""Bytes CRC'd and then copied at a time: they are still in the CPU's cache when copied."""
WINDOW = 64 << 20
"""The most bytes of a run mapped at a time: a chunk of GBs is mapped, copied and unmapped
a window after another, so the source pages a process has mapped stay under this."""
MIN_RUN = 1 << 20
"""The fewest bytes a region's runs hold on average for it to be copied here.

Each run costs an open, a mapping and a copy call: for the few hundred bytes a chunk of
a 1,024-rank save holds, reading them (one ``pread`` into the step's buffer) costs less.
"""


def worth_copying(runs: Sequence[StoredRun]) -> bool:
    """Return whether ``runs`` are long enough, on average, to be copied from a mapping (``MIN_RUN``)."""
    return sum(run.length for run in runs) >= MIN_RUN * len(runs)


def copy_runs(runs: Sequence[StoredRun], fd: int, offset: int, dst: Path, key: str) -> int:
    """Write ``runs`` one after another from byte ``offset`` of ``fd`` (file ``dst``).

    Returns the CRC-32 of all the bytes written. Each run's bytes are noted in the
    active ledger against the source record they lie in (tensor ``key``'s).
    """
    ledger = active()
    crc = 0
    for run in _windows(runs):
        with _mapped(run) as (src_fd, view):
            run_crc = _copy_checked(src_fd, view, run.offset, fd, offset, dst)
            if ledger is not None and run.written is not None:
                ledger.expect(run.written, [key])
                ledger.note(*run.written.key, run.offset - run.written.start, view, run_crc)
        crc = isal_zlib.crc32_combine(crc, run_crc, run.length)
        offset += run.length
    return crc


def _windows(runs: Sequence[StoredRun]) -> Iterator[StoredRun]:
    """Yield ``runs`` cut into runs of at most ``WINDOW`` bytes, in order."""
    for run in runs:
        for at in range(0, run.length, WINDOW):
            length = min(WINDOW, run.length - at)
            yield StoredRun(run.path, run.offset + at, length, run.written)


def _copy_checked(
    src_fd: int, view: memoryview, src_offset: int, fd: int, offset: int, dst: Path
) -> int:
    """Copy ``view`` (at ``src_offset`` of ``src_fd``) to ``offset`` of ``fd`` a slice at a time; return its CRC-32."""
    crc = 0
    kernel = True
    with writing(dst):
        for at in range(0, len(view), SLICE):
            part = view[at : at + SLICE]
            crc = isal_zlib.crc32_combine(crc, isal_zlib.crc32(part), len(part))
            if kernel:
                kernel = _kernel_copy(src_fd, src_offset + at, fd, offset + at, len(part))
            if not kernel:
                pwrite_all(fd, part, offset + at)
    return crc


def _kernel_copy(src_fd: int, src_offset: int, fd: int, offset: int, length: int) -> bool:
    """Copy ``length`` bytes between the files in the kernel; False (nothing copied) where it cannot."""
    done = 0
    while done < length:
        try:
            n = os.copy_file_range(src_fd, fd, length - done, src_offset + done, offset + done)
        except OSError as exc:
            if exc.errno in _NO_KERNEL_COPY and not done:
                return False
            raise
        if n == 0:
            # The source ended early: what was copied is rewritten from the mapping.
            return False
        done += n
    return True


_NO_KERNEL_COPY = frozenset({errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL})
"""What ``copy_file_range`` answers where it cannot copy between two files."""


@contextmanager
def _mapped(run: StoredRun) -> Iterator[tuple[int, memoryview]]:
    """Open and map ``run``'s bytes read-only; yield the descriptor and the bytes, closed on leaving."""
    start = run.offset - run.offset % mmap.ALLOCATIONGRANULARITY
    fd = open_source(run.path)
    try:
        # Populated in one call: a fault per page would cost more than the copy.
        flags = mmap.MAP_SHARED | mmap.MAP_POPULATE
        length = run.offset + run.length - start
        mapping = mmap.mmap(fd, length, flags=flags, prot=mmap.PROT_READ, offset=start)
    except OSError as exc:
        os.close(fd)
        raise os_error(exc, run.path) from None
    whole = memoryview(mapping)
    view = whole[run.offset - start :]
    try:
        yield fd, view
    finally:
        view.release()
        whole.release()
        mapping.close()
        os.close(fd)
