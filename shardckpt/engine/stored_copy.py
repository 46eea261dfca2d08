"""Source bytes written as they lie: mapped from SRC's files, checked and written in one pass.

Where a region's bytes lie in SRC exactly as they are to be written
(``Reader.stored_runs``: a DCP chunk's rows, no cast), reading them into a buffer and
writing them from it would copy every byte into user space and out again. Here each run
is mapped (``mmap``, populated in one call) and ``pwrite`` copies it from the page cache
into DST's file: one copy, in the kernel, as ``cp`` makes. Its CRC-32 is taken a slice at
a time just before the slice is written, while it is in the CPU's cache, and serves twice:
the source's check (noted in the command's ledger, as a reader notes what it read) and the
checksum of the record written (a safetensors digest, a zip record's CRC-32).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from isal import isal_zlib

from shardckpt.codecs.zip_skeleton import pwrite_all
from shardckpt.core.files import os_error, writing
from shardckpt.formats.base import StoredRun
from shardckpt.state.checksums import active

SLICE = 1 << 20
"""Bytes CRC'd and then written at a time: they are still in the CPU's cache when copied."""


def copy_runs(runs: Sequence[StoredRun], fd: int, offset: int, dst: Path, key: str) -> int:
    """Write ``runs`` one after another from byte ``offset`` of ``fd`` (file ``dst``).

    Returns the CRC-32 of all the bytes written. Each run's bytes are noted in the
    active ledger against the source record they lie in (tensor ``key``'s).
    """
    ledger = active()
    crc = 0
    for run in runs:
        with _mapped(run) as view:
            run_crc = _write_checked(view, fd, offset, dst)
            if ledger is not None and run.written is not None:
                ledger.expect(run.written, [key])
                ledger.note(*run.written.key, run.offset - run.written.start, view, run_crc)
        crc = isal_zlib.crc32_combine(crc, run_crc, run.length)
        offset += run.length
    return crc


def _write_checked(view: memoryview, fd: int, offset: int, dst: Path) -> int:
    """Write ``view`` at ``offset`` of ``fd`` a slice at a time; return its CRC-32."""
    crc = 0
    with writing(dst):
        for at in range(0, len(view), SLICE):
            part = view[at : at + SLICE]
            crc = isal_zlib.crc32_combine(crc, isal_zlib.crc32(part), len(part))
            pwrite_all(fd, part, offset + at)
    return crc


@contextmanager
def _mapped(run: StoredRun) -> Iterator[memoryview]:
    """Map ``run``'s bytes read-only; yield them, unmapped on leaving."""
    start = run.offset - run.offset % mmap.ALLOCATIONGRANULARITY
    try:
        fd = os.open(run.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            # Populated in one call: a fault per page would cost more than the copy.
            flags = mmap.MAP_SHARED | mmap.MAP_POPULATE
            mapping = mmap.mmap(
                fd, run.offset + run.length - start, flags=flags, prot=mmap.PROT_READ, offset=start
            )
        finally:
            os.close(fd)
    except OSError as exc:
        raise os_error(exc, run.path) from None
    whole = memoryview(mapping)
    view = whole[run.offset - start :]
    try:
        yield view
    finally:
        view.release()
        whole.release()
        mapping.close()
