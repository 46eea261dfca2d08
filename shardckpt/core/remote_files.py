"""SRC's data objects read where they lie: local stand-ins whose bytes come from ranged requests.

A URL SRC is laid out on the node's disk as a directory of stand-ins (``api/storage``): its
small objects (DCP's ``.metadata``) fetched whole, and each data object a reader reads
only through ``core.files`` (``preadv``, ``pread``, ``source_stream``; DCP's ``.distcp``)
as an empty sparse file of the object's size, registered here by its inode
(``stand_in``). The gate, the listings and the sizes work on a stand-in as on any local
file and no byte of it is on the disk; every byte read from one comes from the store, in
ranged GETs of at most ``PART`` bytes, ``IN_FLIGHT`` at once.

Bytes are fetched in blocks of ``PART`` on a grid of the object, ``IN_FLIGHT`` requests at
once, and a process holds the last ``HELD`` blocks: a chunk's zip headers, its rows and
the next chunk's headers are one request, not three. A reader that reads on (the next
block) has the ``AHEAD`` blocks after it fetched ahead; one that says what it reads next
(``files.will_read``: the runs a stored copy copies, a tensor's chunks, verify's span) has
their first blocks fetched at once. Memory: ``HELD * PART`` bytes per process at most.
Each request is retried as any request to the store is (``storage.retried``), then one
line names the object.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardckpt.core.errors import BadInputError
from shardckpt.core.storage import retried

PART = 4 << 20
"""Bytes asked for in one ranged GET: large enough that the request's cost is small beside its transfer."""
IN_FLIGHT = 4
"""Ranged GETs a process has in flight at once."""
AHEAD = 4
"""Blocks fetched ahead of a reader that reads on."""
HELD = 16
"""Blocks a process holds (fetched, or on their way): ``HELD * PART`` bytes of memory at most."""


@dataclass(frozen=True, eq=False)
class RemoteObject:
    """One object of SRC that a local stand-in stands for."""

    fs: Any
    """The fsspec filesystem that reaches it."""
    key: str
    """Its path in the filesystem's own form (``bucket/prefix/__0_0.distcp``)."""
    url: str
    """Its URL, as errors name it."""
    size: int


@dataclass
class Requests:
    """What this process asked the store for, for data objects: requests and bytes."""

    count: int = 0
    bytes: int = 0


requests = Requests()
"""The ranged GETs this process sent (``--verbose`` says them; the tests count them)."""

_objects: dict[tuple[int, int], RemoteObject] = {}
_lock = threading.RLock()
_pool: ThreadPoolExecutor | None = None


def stand_in(path: Path, obj: RemoteObject) -> tuple[int, int]:
    """Register the file ``path`` (empty, sparse, of ``obj``'s size) as the stand-in of ``obj``; return its key."""
    st = os.stat(path)
    key = (st.st_dev, st.st_ino)
    with _lock:
        _objects[key] = obj
    return key


def forget(keys: Iterable[tuple[int, int]]) -> None:
    """Unregister stand-ins (their files are about to be removed: an inode may be used again)."""
    with _lock:
        for key in keys:
            _objects.pop(key, None)
        if not _objects:
            _held.clear()


def of_fd(fd: int) -> RemoteObject | None:
    """Return the object the file open as ``fd`` stands for; None for a local file (no cost without stand-ins)."""
    if not _objects:
        return None
    st = os.fstat(fd)
    return _objects.get((st.st_dev, st.st_ino))


def of_path(path: str | os.PathLike) -> RemoteObject | None:
    """Return the object the file ``path`` stands for; None for a local file."""
    if not _objects:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return _objects.get((st.st_dev, st.st_ino))


def _fetch(obj: RemoteObject, start: int, end: int) -> bytes:
    """Return bytes [start, end) of ``obj`` (fewer where the object now ends first): one ranged GET."""
    try:
        data = retried(lambda: obj.fs.cat_file(obj.key, start=start, end=end), obj.url)
    except BadInputError as missing:  # listed when the run began: removed since
        raise BadInputError(
            missing.message.replace("no such object or prefix", "was removed while it was read"),
            path=obj.url,
            hint="SRC changed during the run; convert a checkpoint that no process is writing "
            "or removing",
        ) from None
    with _lock:
        requests.count += 1
        requests.bytes += len(data)
    return data


def _submit(obj: RemoteObject, start: int, end: int) -> Future:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="shardckpt-get")
        pool = _pool
    return pool.submit(_fetch, obj, start, end)


class _Blocks:
    """The blocks of SRC's objects fetched or on their way: ``PART`` bytes each, on a grid, least recently used dropped.

    A reader that reads on (the next block, or a whole one) has the ``AHEAD`` blocks after
    it fetched ahead; one that jumps back (a chunk's rows after its zip's last record)
    finds its block still held. Held: ``HELD`` blocks, so memory stays bounded.
    """

    def __init__(self) -> None:
        self.held: OrderedDict[tuple[int, int], Future] = OrderedDict()
        self.last: dict[int, int] = {}  # the last block read of each object

    def clear(self) -> None:
        with _lock:
            self.held.clear()
            self.last.clear()

    def get(self, obj: RemoteObject, index: int) -> Future:
        """Return the block ``index`` of ``obj`` (fetched, or on its way)."""
        with _lock:
            key = (id(obj), index)
            found = self.held.get(key)
            if found is None:
                start = index * PART
                found = _submit(obj, start, min(start + PART, obj.size))
                self.held[key] = found
                while len(self.held) > HELD:
                    self.held.popitem(last=False)
            self.held.move_to_end(key)
            return found

    def read_on(self, obj: RemoteObject, first: int, last: int) -> None:
        """Note that blocks ``first``..``last`` of ``obj`` are read; fetch ahead when it reads on."""
        with _lock:
            before = self.last.get(id(obj))
            self.last[id(obj)] = last
            if before is None or not before <= first <= before + 1 and first == last:
                return  # a first or a lone read: nothing says what comes next
            for index in range(last + 1, min(last + 1 + AHEAD, _blocks(obj))):
                self.get(obj, index)


def _blocks(obj: RemoteObject) -> int:
    return -(-obj.size // PART)


_held = _Blocks()


def will_read(obj: RemoteObject, ranges: Iterable[tuple[int, int]]) -> None:
    """Say that ranges (start, length) of ``obj`` are read next, in this order: their first blocks are fetched ahead."""
    wanted: list[int] = []
    for start, length in ranges:
        if length > 0 and start < obj.size:
            end = min(start + length, obj.size)
            wanted += range(start // PART, (end - 1) // PART + 1)
            if len(wanted) >= AHEAD:
                break
    for index in list(dict.fromkeys(wanted))[:AHEAD]:
        _held.get(obj, index)


def read_into(obj: RemoteObject, view: memoryview, at: int) -> int:
    """Fill ``view`` from byte ``at`` of ``obj``; return how many bytes (fewer where the object ends)."""
    n = max(0, min(len(view), obj.size - at))
    if n == 0:
        return 0
    first, last = at // PART, (at + n - 1) // PART
    _held.read_on(obj, first, last)
    done = 0
    for index in range(first, last + 1):
        block = _held.get(obj, index).result()
        lo = max(at, index * PART) - index * PART
        got = block[lo : lo + n - done]
        view[done : done + len(got)] = got
        done += len(got)
        if len(block) < min(PART, obj.size - index * PART):
            break  # the object is shorter than when it was listed
    return done
