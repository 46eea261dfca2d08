"""Buffers that ``pread`` fills at the page cache's speed, wherever in a page a read starts.

The kernel copies a file's bytes out of its page-cache pages, where each byte lies at
its file offset's place within a page. Where the buffer's place within a page is a few
bytes ahead of that, each load of the copy waits on the store just before it, whose
address matches it in the low 12 bits (4K aliasing). A ``bytearray`` of megabytes
starts 16 bytes into a page (glibc's header of the mapping it gets), so reading a
page-aligned file offset into it ran at 1.6 GB/s here, from tmpfs, where the same read
into a buffer placed as the offset is ran at 8.5-10 GB/s (docs/benchmark.md, "Reading
into a buffer placed as the file is").

So a ``ReadBuffer`` is a page-aligned anonymous mapping one page longer than its size,
and ``for_read`` gives each read the part that starts at the file offset's place in a page.
"""

from __future__ import annotations

import mmap

PAGE = mmap.PAGESIZE


class ReadBuffer:
    """``size`` bytes to read into, placed for each read as the file's bytes are (``for_read``)."""

    def __init__(self, size: int):
        self.size = size
        self._view = memoryview(mmap.mmap(-1, size + PAGE))

    def for_read(self, offset: int, length: int | None = None) -> memoryview:
        """Return the buffer to read ``length`` bytes (at most ``size``; all by default) from file byte ``offset`` into."""
        start = offset % PAGE
        stop = start + (self.size if length is None else min(length, self.size))
        return self._view[start:stop]
