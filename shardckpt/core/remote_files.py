"""SRC's data objects read where they lie: local stand-ins whose bytes come from ranged requests.

A URL SRC is laid out on the node's disk as a directory of stand-ins (``api/storage``): its
small objects (DCP's ``.metadata``) fetched whole, and each data object a reader reads
only through ``core.files`` (``preadv``, ``pread``, ``source_stream``; DCP's ``.distcp``,
safetensors and torch.save files: ``storage.read_in_place``) as an empty sparse file of
the object's size, registered here by its inode (``stand_in``). The gate, the listings
and the sizes work on a stand-in as on any local file and no byte of it is on the disk;
every byte read from one comes from the store, in ranged GETs of at most ``PART`` bytes,
``IN_FLIGHT`` at once.

A reader that says what it reads next (``files.will_read``: the runs a stored copy
copies, said for a whole batch as the copies are queued; a tensor's chunks; verify's
span) has those ranges fetched ahead in order (consecutive ones as one span), in
``PART``s, ``IN_FLIGHT`` requests at once, and takes its bytes from there, a part kept
until all of it is taken (by any thread); a small read (a chunk's zip headers) is served
from a ``SMALL`` block on a grid of the object, the last ``HELD`` kept, so the headers
and rows of neighbouring small chunks are one request; scattered small reads said at
once (a zip's local headers: ``read_each``) are a request of their own size each; any
other read is fetched as asked. Memory: ``2 * IN_FLIGHT * PART + HELD * SMALL`` bytes per process (40 MiB). Each
request is retried as any request to the store is (``storage.retried``), then one line
names the object.
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
SMALL = 256 << 10
"""A read of fewer bytes is served from a block of this many on a grid of the object."""
HELD = 32
"""Small blocks a process keeps (``HELD * SMALL`` bytes)."""


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
    """Unregister stand-ins (their files are about to be removed: an inode may be used again).

    With the last one, what was fetched ahead goes and the threads that fetch end: none
    outlives the command (``cli.app`` ends the process at once only when no thread runs).
    """
    global _pool
    with _lock:
        for key in keys:
            _objects.pop(key, None)
        if _objects:
            return
        _small.clear()
        _ahead.clear()
        pool, _pool = _pool, None
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)


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
    """Small blocks of SRC's objects (``SMALL`` bytes on a grid), the last ``HELD`` kept: for small reads.

    A chunk's zip headers (its first and last 32 KiB), the next chunk's, and the rows of a
    small chunk lie in one block: one request, not one per read.
    """

    def __init__(self) -> None:
        self.held: OrderedDict[tuple[int, int], Future] = OrderedDict()

    def clear(self) -> None:
        with _lock:
            self.held.clear()

    def get(self, obj: RemoteObject, index: int) -> Future:
        with _lock:
            key = (id(obj), index)
            found = self.held.get(key)
            if found is None:
                start = index * SMALL
                found = self.held[key] = _submit(obj, start, min(start + SMALL, obj.size))
                while len(self.held) > HELD:
                    self.held.popitem(last=False)
            self.held.move_to_end(key)
            return found


class _Part:
    __slots__ = ("obj", "start", "end", "future", "left")

    def __init__(self, obj: RemoteObject, start: int, end: int):
        self.obj, self.start, self.end = obj, start, end
        self.future: Future | None = None
        self.left = end - start
        """Its bytes no read has taken yet: at 0 it is dropped."""


def _coalesced(obj: RemoteObject, ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Return ``ranges`` (start, length) as [start, end) spans of ``obj``, each run of consecutive ones as one.

    A tensor after tensor of a file, the runs of neighbouring chunks: one span, fetched
    in ``PART``s, instead of a short request at each one's end (or a ``SMALL`` block
    fetched beside a part that holds the same bytes).
    """
    spans: list[tuple[int, int]] = []
    for start, length in ranges:
        end = min(start + length, obj.size)
        if end <= start:
            continue
        if spans and spans[-1][1] == start:
            spans[-1] = (spans[-1][0], end)
        else:
            spans.append((start, end))
    return spans


class _Ahead:
    """The ranges said to be read next (``will_read``), in ``PART``s, in order.

    At most ``IN_FLIGHT`` of them are being fetched and ``2 * IN_FLIGHT`` held fetched. A
    part is dropped once its every byte was taken, by one reader or by several (worker
    threads copying pieces of one run, or runs of one part); a part no read takes (its
    reader went another way) is dropped, oldest first, once newer ones wait, so it never
    stops the fetching of the others. A read never drops another's part: two threads
    reading different runs keep each other's fetched ahead.
    """

    def __init__(self) -> None:
        self.parts: list[_Part] = []

    def clear(self) -> None:
        with _lock:
            self.parts = []

    def plan(self, obj: RemoteObject, ranges: Iterable[tuple[int, int]]) -> None:
        with _lock:
            planned = {(p.start, p.end) for p in self.parts if p.obj is obj}
            for start, end in _coalesced(obj, ranges):
                if end - start < SMALL:  # read as small reads are: their blocks, fetched now
                    for index in range(start // SMALL, (end - 1) // SMALL + 1):
                        _small.get(obj, index)
                    continue
                for a in range(start, end, PART):
                    b = min(a + PART, end)
                    if (a, b) not in planned:  # said twice (a run and its piece): fetched once
                        self.parts.append(_Part(obj, a, b))
                        planned.add((a, b))
            self._start()

    def _start(self) -> None:
        started = [p for p in self.parts if p.future is not None]
        waiting = [p for p in self.parts if p.future is None]
        while waiting and len(started) >= 2 * IN_FLIGHT:
            done = [p for p in started if p.future.done()]  # type: ignore[union-attr]
            if not done:
                break
            self.parts.remove(done[0])  # fetched, never taken: its reader went another way
            started.remove(done[0])
        busy = sum(1 for p in started if not p.future.done())  # type: ignore[union-attr]
        for part in waiting:
            if busy >= IN_FLIGHT or len(started) >= 2 * IN_FLIGHT:
                break
            part.future = _submit(part.obj, part.start, part.end)
            part.future.add_done_callback(_restart)
            started.append(part)
            busy += 1

    def take(self, obj: RemoteObject, at: int) -> _Part | None:
        """Return the planned part holding byte ``at`` of ``obj`` (its fetch started if it was not)."""
        with _lock:
            for part in self.parts:
                if part.obj is obj and part.start <= at < part.end:
                    if part.future is None:
                        part.future = _submit(obj, part.start, part.end)
                    return part
        return None

    def taken(self, part: _Part, n: int) -> None:
        """Count ``n`` more bytes of ``part`` as read; once all are (or it ends short), drop it and start the next."""
        with _lock:
            part.left -= n
            if part.left > 0 and n:
                return
            if part in self.parts:
                self.parts.remove(part)
            self._start()


_small = _Blocks()
_ahead = _Ahead()


def _restart(_: Future) -> None:
    """Start the next planned parts once one is fetched."""
    with _lock:
        _ahead._start()


def will_read(obj: RemoteObject, ranges: Iterable[tuple[int, int]]) -> None:
    """Say that ranges (start, length) of ``obj`` are read next, in this order: they are fetched ahead."""
    _ahead.plan(obj, ranges)


def read_into(obj: RemoteObject, view: memoryview, at: int) -> int:
    """Fill ``view`` from byte ``at`` of ``obj``; return how many bytes (fewer where the object ends).

    From the parts fetched ahead where it was planned; a small read from a small block;
    any other in ``PART``s, ``IN_FLIGHT`` at once.
    """
    n = max(0, min(len(view), obj.size - at))
    done = 0
    while done < n:
        pos = at + done
        part = _ahead.take(obj, pos)
        if part is not None:
            data = part.future.result()  # type: ignore[union-attr]
            got = data[pos - part.start : min(part.end, at + n) - part.start]
            view[done : done + len(got)] = got
            done += len(got)
            _ahead.taken(part, len(got))
            if len(data) < part.end - part.start and not got:
                break  # the object is shorter than when it was listed
        elif n - done < SMALL:
            index = pos // SMALL
            block = _small.get(obj, index).result()
            got = block[pos - index * SMALL : pos - index * SMALL + n - done]
            view[done : done + len(got)] = got
            done += len(got)
            if not got:
                break
        else:
            got = _read_unplanned(obj, view[done:n], pos)
            done += got
            if done < n:
                break
    return done


def read_each(obj: RemoteObject, ranges: list[tuple[int, int]]) -> list[bytes]:
    """Return the bytes of each range (start, length) of ``obj``: one ranged GET each, ``IN_FLIGHT`` at once."""
    futures = [_submit(obj, at, min(at + n, obj.size)) if n > 0 else None for at, n in ranges]
    return [f.result() if f is not None else b"" for f in futures]


def _read_unplanned(obj: RemoteObject, view: memoryview, at: int) -> int:
    """Read ``view`` from byte ``at`` in ``PART``s, ``IN_FLIGHT`` at once; return how many bytes."""
    done = 0
    while done < len(view):
        window = []
        for start in range(done, min(len(view), done + IN_FLIGHT * PART), PART):
            end = min(start + PART, len(view))
            window.append((start, end, _submit(obj, at + start, at + end)))
        for start, end, future in window:
            data = future.result()
            view[start : start + len(data)] = data
            if len(data) < end - start:
                return start + len(data)
        done = window[-1][1]
    return done
