"""A URL DST, committed last: data objects first, then the objects a reader takes as the commit.

Every data object goes up first, then the objects a reader takes as the checkpoint's
commit (DCP's ``.metadata``; ``upload``). S3's data objects are multipart uploads whose
parts carry their CRC-32 (``Uploads``; a file job's parts are sent while the fill writes
it, ``stream_into``; under torchrun a file every rank filled is one upload whose parts
every rank sends, ``_together``). A marker object beside DST
(``.NAME.shardckpt-partial``) says a run is writing it, so the next run knows what it
finds there for a killed run's leftovers (``clear_leftovers``) and aborts its open
multipart uploads. Stores, URLs, retries and
the one line of a failed request are ``core/storage.py``'s.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import errno
import os
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from isal import isal_zlib

from shardckpt.core import marker
from shardckpt.core.errors import (
    DestinationExistsError,
    IOFailure,
    UsageError,
    notice,
)
from shardckpt.core.libc import linux_call
from shardckpt.core.parts import (
    MOST_PARTS,
    PART_BYTES,
    Part,
    dealt,
    natural,
    part_size,
    parts_of,
)
from shardckpt.core.signals import committing, reopened
from shardckpt.core.storage import Store, on_s3, retried, store_error

T = TypeVar("T")


def _under(store: Store) -> list[str]:
    """Return every object at DST: the object itself, or those under the prefix."""
    try:
        if store.fs.isfile(store.path):
            return [store.path]
        return [p for p in store.fs.find(store.path + "/") if p != store.path]
    except FileNotFoundError:
        return []


def _abort_uploads(store: Store) -> int:
    """Abort the open multipart uploads of objects at DST (S3); return how many."""
    listing = getattr(store.fs, "list_multipart_uploads", None)
    if listing is None:
        return 0
    bucket, _, key = store.path.partition("/")
    uploads = [
        u
        for u in listing(bucket)
        if u.get("Key", "") == key or u.get("Key", "").startswith(key + "/")
    ]
    for upload in uploads:
        # Under torchrun every rank aborts them: one another rank aborted first is gone.
        with contextlib.suppress(FileNotFoundError):
            store.fs.call_s3(
                "abort_multipart_upload",
                Bucket=bucket,
                Key=upload["Key"],
                UploadId=upload["UploadId"],
            )
    return len(uploads)


def clear_leftovers(store: Store, commits: Sequence[str]) -> None:
    """Take DST's marker (S3: exit 4 while a live run holds it) and remove what a dead run left: data objects (uncommitted), open uploads."""
    if marker.conditional(store):
        whose = marker.take(store)
        if whose is not None:
            retried(lambda: _clear(store, commits, whose), store.url, writing=True)
        return

    def clear() -> None:
        if store.fs.exists(marker.path(store)):
            _clear(store, commits, "")
            store.fs.rm(marker.path(store))

    retried(clear, store.url, writing=True)


def _clear(store: Store, commits: Sequence[str], whose: str) -> None:
    """Remove what the run ``whose`` ("": unnamed) left at DST, unless its commit began; abort its open uploads."""
    found = [key[len(store.path) + 1 :] for key in _under(store)]
    committed = bool(commit_objects(found, commits))  # a commit began: never removed
    if not committed:
        found = _under(store)
        if found:
            store.fs.rm(found)
    aborted = _abort_uploads(store)
    if not committed:
        run = f" ({whose})" if whose else ""
        notice(
            f"removed what a run that did not finish{run} left at '{store.url}' "
            f"(uncommitted objects and {aborted} open uploads)"
        )


def check_bucket(store: Store) -> None:
    """Raise when DST is a whole bucket, or its bucket is missing (one line), before anything is put beside it."""
    if store.fs.root_marker == "":  # an object store: the first part of a path is its bucket
        bucket, _, key = store.path.partition("/")
        if not key:
            raise UsageError(
                "names a whole bucket", path=store.url, hint="name a prefix inside it for DST"
            )
        if not retried(lambda: store.fs.exists(bucket), store.url, writing=True):
            raise store_error(FileNotFoundError(bucket), store.url, writing=True)


def check_dst(store: Store, *, overwrite: bool) -> None:
    """Raise when DST holds objects and --overwrite was not given."""
    if not overwrite and retried(lambda: _under(store), store.url):
        raise DestinationExistsError(
            "already exists",
            path=store.url,
            hint="pass --overwrite to replace it (every object under it), or name another DST",
        )


def commit_objects(names: Sequence[str], commits: Sequence[str]) -> list[str]:
    """Return which of ``names`` (paths under DST) are its commit objects, in the order to put them.

    A commit written with a ``/`` is that path; without one it is that file in any
    directory (``.metadata``: a trainer's DCP in a subdirectory too), deepest first.
    """
    chosen: list[str] = []
    for commit in commits:
        found = [
            n for n in names if n == commit or ("/" not in commit and n.endswith("/" + commit))
        ]
        chosen += sorted(found, key=lambda n: (-n.count("/"), n))
    return list(dict.fromkeys(chosen))


def split(local: Path, commits: Sequence[str]) -> tuple[list[str], list[str]]:
    """Return the files of the complete output ``local``: its data files, and its commit files in the order to put them.

    ``""`` stands for ``local`` itself, a single-file output: its one object is the commit.
    """
    if not local.is_dir():
        return [], [""]
    files = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
    last = commit_objects(files, commits)
    return [f for f in files if f not in last], last


def share(names: Sequence[str], rank: int, world_size: int) -> list[str]:
    """Return the data files rank ``rank`` of ``world_size`` uploads: every ``world_size``-th, in natural order.

    A per-rank file of target rank r (DCP's ``__r_0.distcp``) was written by the process
    acting for it, process r mod N (``core.placement``): that process uploads it.
    """
    return sorted(names, key=natural)[rank::world_size]


def begin_upload(store: Store, *, overwrite: bool) -> None:
    """Put the marker beside DST (the coordinator, before any rank uploads); with ``overwrite`` remove the old DST.

    No reader sees the old commit object over new data.
    """
    marker.put(store)
    if overwrite and (old := retried(lambda: _under(store), store.url)):
        retried(lambda: store.fs.rm(old), store.url, writing=True)


def put_data(
    local: Path,
    store: Store,
    names: Sequence[str],
    uploads: Uploads | None = None,
    parts: Mapping[str, tuple[str, Sequence[Part]]] | None = None,
) -> dict[str, list[dict]]:
    """Upload the data files ``names`` of ``local`` (several at once; each large one as a multipart upload).

    With ``uploads`` (S3): through it, each part with its CRC-32, and every upload it holds
    (those streamed during the fill too) completed before returning; with ``parts`` (file:
    its upload's id and the parts of it this process sends), those parts too, returned
    sent but not completed (``Uploads.finish``).
    """
    if uploads is None:
        _put(local, store, names)
        return {}
    for name, (upload_id, mine) in (parts or {}).items():
        uploads.send(name, _local(local, name), upload_id, mine)
    for name in names:
        uploads.whole(name, _local(local, name), _local(local, name).stat().st_size)
    return uploads.finish()


def _local(local: Path, name: str) -> Path:
    """Return the staged file of DST file ``name`` (``""``: the single-file DST ``local`` itself)."""
    return local / name if name else local


def commit(
    local: Path,
    store: Store,
    last: Sequence[str],
    sent: Mapping[str, Callable[[], None]] | None = None,
) -> None:
    """Upload the commit files ``last`` (once every data file is uploaded), then remove the marker.

    One after another, in their order; one whose parts every rank ``sent`` already is
    its upload's completion (the callable). Once it starts, a signal waits until DST is
    committed (then exit 0).
    """
    marker.confirm(store)
    with committing(f"'{store.url}'"):
        for name in last:
            if sent and name in sent:
                sent[name]()
            elif checks_parts(store):
                put_data(local, store, [name], Uploads(store))
            else:
                _put(local, store, [name])
        marker.release(store)


def abort(store: Store) -> None:
    """Abort DST's open multipart uploads, best effort (the next run aborts what is left).

    None where another run took DST over (``marker.lost``): they are that run's.
    """
    with contextlib.suppress(Exception):
        if not marker.lost(store):
            _abort_uploads(store)


def abandon(store: Store) -> None:
    """Clear DST of a run that failed before any data object was complete: its open uploads, its marker (best effort)."""
    with contextlib.suppress(Exception):
        if marker.lost(store):
            return
        _abort_uploads(store)
        marker.release(store)


def upload(
    local: Path,
    store: Store,
    commits: Sequence[str],
    *,
    overwrite: bool,
    rank: int = 0,
    world_size: int = 1,
    agreed: Callable[[Callable[[], T]], T] = lambda step: step(),
    all_gather: Callable[[T], list[T]] = lambda mine: [mine],
    uploads: Uploads | None = None,
    streamed: Collection[str] = (),
) -> None:
    """Upload the complete output ``local`` to DST, the objects named ``commits`` last.

    A marker beside DST is put first and removed last, by rank 0 (put already when
    ``uploads`` began during the fill, ``Uploads.begin``). Each of ``world_size`` processes
    uploads its ``share`` of the data files no rank ``streamed`` during the fill, and
    completes its own uploads; the commit objects go once every share is up. Under torchrun
    ``agreed`` and ``all_gather`` are the runtime's (each step ends on every rank together;
    a failure on one is every rank's); on S3 each file larger than a part is sent by every
    rank (``_together``). A failure aborts the open multipart uploads and leaves no commit
    object; the next run clears the rest (``clear_leftovers``).
    """
    reopened()  # the local output was only DST's stand-in: a signal stops the upload
    first, last = split(local, commits)
    rest = [name for name in first if name not in streamed]
    begun = uploads is not None and uploads.begun
    try:
        agreed(lambda: rank == 0 and not begun and begin_upload(store, overwrite=overwrite))
        if uploads is not None and world_size > 1:
            _together(local, store, rest, last, uploads, rank, world_size, agreed, all_gather)
        else:
            agreed(lambda: put_data(local, store, share(rest, rank, world_size), uploads))
            agreed(lambda: rank == 0 and commit(local, store, last))
    except BaseException:
        if uploads is not None:
            uploads.abort()
        if world_size == 1 and not (uploads is not None and uploads.completed):
            abandon(store)  # nothing of the run is at DST: not even its marker
        else:
            abort(store)
        raise


def _together(
    local: Path,
    store: Store,
    rest: Sequence[str],
    last: Sequence[str],
    uploads: Uploads,
    rank: int,
    world_size: int,
    agreed: Callable[[Callable[[], T]], T],
    all_gather: Callable[[T], list[T]],
) -> None:
    """Upload the staged DST from ``world_size`` ranks on its node: a file larger than a part is one upload, its parts from every rank.

    1) (owners) open the uploads of the files larger than ``PART_BYTES``: rank 0 those of
       commit objects (it completes them last), each data file's the rank ``share``
       deals it to; every rank learns their ids.
    2) (all ranks) each sends its ``dealt`` parts of them, read from the staged file with
       their CRC-32s, and its ``share`` of the smaller files (one PUT each); every rank
       learns every part's ETag and CRC-32.
    3) (owners) complete the data files' uploads; 4) (rank 0) ``commit``, completing a
       commit object's upload in its turn.
    """
    sizes = {name: _local(local, name).stat().st_size for name in [*rest, *last]}
    large = {name: size for name, size in sizes.items() if size > PART_BYTES}
    small = [name for name in rest if name not in large]
    data = [name for name in rest if name in large]
    owned = share(data, rank, world_size) + ([n for n in last if n in large] if rank == 0 else [])
    opened = agreed(lambda: {name: uploads.open(name, large[name]) for name in owned})
    ids = {name: upload_id for got in all_gather(opened) for name, upload_id in got.items()}
    mine = {name: (ids[name], parts) for name, parts in dealt(large, rank, world_size).items()}
    sent = agreed(lambda: put_data(local, store, share(small, rank, world_size), uploads, mine))
    parts = _every_part(all_gather(sent), large)

    def completer(name: str) -> Callable[[], None]:
        return lambda: uploads.complete(name, ids[name], parts[name])

    agreed(lambda: [completer(name)() for name in owned if name not in last])
    sent_commits = {name: completer(name) for name in last if name in large}
    agreed(lambda: rank == 0 and commit(local, store, last, sent_commits))


def _every_part(
    sent: Sequence[Mapping[str, list[dict]]], sizes: Mapping[str, int]
) -> dict[str, list[dict]]:
    """Return the parts every rank ``sent`` of each file of ``sizes``, in order: each of its parts once."""
    parts: dict[str, list[dict]] = {name: [] for name in sizes}
    for by_rank in sent:
        for name, done in by_rank.items():
            parts[name] += done
    for name, done in parts.items():
        done.sort(key=lambda part: part["PartNumber"])
        if [part["PartNumber"] for part in done] != [n for n, _, _ in parts_of(sizes[name])]:
            raise RuntimeError(f"internal: the ranks did not send each part of {name!r} once")
    return parts


def _put(local: Path, store: Store, names: Sequence[str]) -> None:
    """Upload ``names`` under ``local`` (``""``: the file ``local`` itself) with the filesystem's ``put``.

    For the stores other than S3 (``gs://``, ``az://``, ``memory://``): one request for the
    filesystem; a failure names the object when there is one, else DST.
    """
    if not names:
        return
    sources = [str(local / name) if name else str(local) for name in names]
    targets = [store.child(name) if name else store.path for name in names]
    url = store.url if len(names) > 1 or not names[0] else f"{store.url}/{names[0]}"
    retried(lambda: store.fs.put(sources, targets), url, writing=True)


# ------------------------------------------------------------------ DST: parts with their CRC-32

PARTS_IN_FLIGHT = 4
"""The most parts (or PUTs) one process sends at once."""
PART_HELD = 2 * PART_BYTES
"""What a part in flight holds: its bytes, and the copy the S3 client makes of them as it
sends them (a 64 MiB PUT through s3fs peaks at 64 MiB more, traced)."""


def parts_in_flight(buffer_bytes: int) -> int:
    """Return how many parts a process sends at once with ``--buffer-size`` ``buffer_bytes``.

    As many as a quarter of the buffer holds (``PART_HELD`` each), from 1 to
    ``PARTS_IN_FLIGHT``: 2 at the default 256 MiB, 4 from 512 MiB, 1 under 256 MiB.
    """
    return max(1, min(PARTS_IN_FLIGHT, buffer_bytes // 4 // PART_HELD))


def checks_parts(store: Store) -> bool:
    """Return whether DST is uploaded by ``Uploads``: S3, whose parts carry a checksum the store checks."""
    return on_s3(store)


def checksum(data) -> str:
    """Return the CRC-32 of ``data`` as S3 takes it (``ChecksumCRC32``): base64 of its 4 big-endian bytes."""
    return base64.b64encode(isal_zlib.crc32(data).to_bytes(4, "big")).decode()


_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


# libc's fallocate(fd, mode, offset, length); None where there is none.
_FALLOCATE = linux_call("fallocate", [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64])


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Give the local disk back the blocks of ``length`` bytes of ``fd`` from ``offset`` (they read as zeros).

    Best effort: where the filesystem cannot (or the call is missing) the bytes stay.
    """
    if _FALLOCATE is not None:
        _FALLOCATE(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length)


def _read_part(fd: int, offset: int, length: int) -> tuple[bytes, str]:
    """Return ``length`` bytes of ``fd`` from ``offset`` and their CRC-32 (``checksum``)."""
    data = os.pread(fd, length, offset)
    while len(data) < length:
        more = os.pread(fd, length - len(data), offset + len(data))
        if not more:
            raise OSError(errno.EIO, f"the staged file ended {length - len(data)} bytes early")
        data += more
    return data, checksum(data)


@dataclass
class _File:
    """One DST file being uploaded: where its bytes lie, how far they went, its parts."""

    path: Path
    fd: int | None = None
    sent: int = 0
    """The bytes handed to parts (or the PUT)."""
    size: int | None = None
    """Known once the file is whole."""
    created: Future[str] | None = None
    """The multipart upload's id (None: the file is one PUT)."""
    parts: list[tuple[int, Future[dict]]] = field(default_factory=list)
    pending: int = 0
    """Parts handed to the pool and not finished: the file stays open while there are any."""
    shared: bool = False
    """Whether its upload is every rank's (``Uploads.send``): this process sends some of its
    parts, and another step completes it."""


class Uploads:
    """This process's uploads to an S3 DST: each file a multipart upload, a part sent once its bytes are final.

    ``final(name, path, upto)``: the first ``upto`` bytes of DST's file ``name`` (the local
    file ``path``) will not change: each whole part among them is sent. ``whole(name,
    path, size)``: the file is complete: the rest goes, as its last part (a file that
    started no upload and holds at most one part goes as one PUT). Parts go
    ``PARTS_IN_FLIGHT`` at a time on threads of their own; a part waiting for a thread is
    only an offset, read from the file when it is sent. ``finish()`` waits for every part
    and completes each upload, ``abort()`` drops the parts not sent and aborts each upload
    opened. ``open``, ``send`` and ``complete`` are the steps of a file whose parts several
    processes send (``_together``). Every part and PUT carries the CRC-32 of its bytes
    (``ChecksumCRC32``), so the store refuses bytes that changed on the way (S3 answers
    400 BadDigest: the part is read and sent again, ``storage.RETRIES`` times).
    """

    def __init__(
        self,
        store: Store,
        *,
        overwrite: bool = False,
        in_flight: int = PARTS_IN_FLIGHT,
        drop_sent: bool = False,
    ):
        self.store = store
        self.drop_sent = drop_sent
        """Whether a part's bytes are dropped from the local file once the store has them
        (``punch_hole``): nothing reads the staged DST after its upload."""
        self.bucket = store.path.partition("/")[0]
        self.overwrite = overwrite
        self.begun = False
        """Whether the marker was put (and an old DST removed) before the fill (``begin``)."""
        self.completed = False
        """Whether an object of DST is complete (an upload completed, or a PUT)."""
        self._in_flight = in_flight
        self._pool: ThreadPoolExecutor | None = None
        self._files: dict[str, _File] = {}
        self._opened: dict[str, str] = {}
        """Uploads this process opened for several processes' parts (``open``), not completed yet."""
        self._lock = threading.Lock()
        self._failed: BaseException | None = None

    @property
    def streamed(self) -> list[str]:
        """Return the files this process took (``final`` or ``whole``): no one else uploads them."""
        return list(self._files)

    def share(self, buffer_bytes: int) -> int:
        """Return what the parts in flight take of a ``--buffer-size`` of ``buffer_bytes``: a quarter at most.

        Under 128 MiB one part is more than that: its excess is held beside the buffer.
        """
        return min(self._in_flight * PART_HELD, buffer_bytes // 4)

    def begin(self, coordinator: bool) -> None:
        """Put the marker beside DST (the coordinator), before any part is sent (agreed, every rank)."""
        if coordinator:
            begin_upload(self.store, overwrite=self.overwrite)
        self.begun = True

    def final(self, name: str, path: Path, upto: int) -> None:
        """Send the whole parts of file ``name`` within its first ``upto`` bytes (they will not change)."""
        self._raise_failure()
        file = self._files.setdefault(name, _File(path))
        while upto - file.sent >= part_size(len(file.parts) + 1):
            self._part(name, file, part_size(len(file.parts) + 1))

    def whole(self, name: str, path: Path, size: int) -> None:
        """Send the rest of file ``name``, complete at ``size`` bytes (one PUT where no part went and it is small)."""
        self._raise_failure()
        file = self._files.setdefault(name, _File(path))
        file.size = size
        if not file.parts and size <= PART_BYTES:
            file.parts.append((1, self._submit(file, self._put_whole, name, file)))
            return
        while file.sent < size:
            self._part(name, file, min(size - file.sent, part_size(len(file.parts) + 1)))

    def open(self, name: str, size: int) -> str:
        """Open the multipart upload of file ``name`` (``size`` bytes) whose parts several processes send; return its id."""
        self._fits(name, len(parts_of(size)))
        self._opened[name] = self._create(name)
        return self._opened[name]

    def send(self, name: str, path: Path, upload_id: str, parts: Sequence[Part]) -> None:
        """Send ``parts`` of file ``name`` (the local file ``path``) to the upload ``upload_id``; ``finish`` returns them, not completed."""
        self._raise_failure()
        created: Future[str] = Future()
        created.set_result(upload_id)
        file = self._files[name] = _File(path, created=created, shared=True)
        for number, offset, length in parts:
            future = self._submit(file, self._send_part, name, file, number, offset, length)
            file.parts.append((number, future))

    def complete(self, name: str, upload_id: str, parts: list[dict]) -> None:
        """Complete the upload ``upload_id`` of file ``name`` with every process's ``parts``, in order."""
        self._complete(name, upload_id, parts)
        self._opened.pop(name, None)

    def finish(self) -> dict[str, list[dict]]:
        """Wait for every part sent; complete each upload (its parts' CRC-32s with it).

        Return the parts sent of the uploads several processes send (``send``), by file:
        those are completed once every process sent its own (``complete``).
        """
        sent: dict[str, list[dict]] = {}
        try:
            for name, file in self._files.items():
                if file.size is None and not file.shared:
                    raise RuntimeError(f"internal: DST file {name!r} was streamed but never ended")
                done = [{"PartNumber": n, **part.result()} for n, part in file.parts]
                if file.shared:
                    sent[name] = done
                elif file.created is not None:  # else one PUT, done with its future
                    self._complete(name, file.created.result(), done)
        finally:
            self._close()
        self._files.clear()
        return sent

    def abort(self) -> None:
        """Drop the parts not sent, wait for those being sent, abort every upload opened (best effort)."""
        self._close(cancel=True)
        opened = dict(self._opened)
        for name, file in self._files.items():
            created = file.created
            if created is not None and created.done() and not created.cancelled():
                with contextlib.suppress(Exception):
                    opened[name] = created.result()
        for name, upload_id in opened.items():
            with contextlib.suppress(Exception):
                self.store.fs.call_s3(
                    "abort_multipart_upload",
                    Bucket=self.bucket,
                    Key=self._key(name),
                    UploadId=upload_id,
                )
        self._files.clear()
        self._opened.clear()

    # -- inside

    def _key(self, name: str) -> str:
        return (self.store.child(name) if name else self.store.path).partition("/")[2]

    def _url(self, name: str) -> str:
        return f"{self.store.url}/{name}" if name else self.store.url

    def _fits(self, name: str, parts: int) -> None:
        """Raise when file ``name`` takes ``parts`` parts, more than one upload takes (S3: 10,000)."""
        if parts > MOST_PARTS:
            raise IOFailure(
                f"is larger than an upload of {MOST_PARTS} parts takes",
                path=self._url(name),
                hint="write a DST with more, smaller files (a larger --world-size)",
            )

    def _raise_failure(self) -> None:
        """Raise the first failure of a part sent: the fill stops at once, not after it."""
        if self._failed is not None:
            raise self._failed

    def _part(self, name: str, file: _File, length: int) -> None:
        """Hand the next ``length`` bytes of ``file`` to the pool as its next part; open its upload first."""
        if file.created is None:
            file.created = self._submit(file, self._create, name)
        number = len(file.parts) + 1
        self._fits(name, number)
        future = self._submit(file, self._send_part, name, file, number, file.sent, length)
        file.parts.append((number, future))
        file.sent += length

    def _submit(self, file: _File, fn: Callable[..., T], *args) -> Future[T]:
        """Run ``fn(*args)`` on the pool, ``file`` open until its last piece of work is done."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._in_flight, thread_name_prefix="shardckpt-upload")
        with self._lock:
            if file.fd is None:
                mode = os.O_RDWR if self.drop_sent else os.O_RDONLY
                file.fd = os.open(file.path, mode | os.O_CLOEXEC)
            file.pending += 1
        future = self._pool.submit(fn, *args)
        future.add_done_callback(lambda f, file=file: self._done(file, f))
        return future

    def _done(self, file: _File, future: Future) -> None:
        with self._lock:
            file.pending -= 1
            if file.pending == 0 and file.fd is not None:
                os.close(file.fd)
                file.fd = None
        if not future.cancelled() and future.exception() is not None and self._failed is None:
            self._failed = future.exception()

    def _create(self, name: str) -> str:
        url = self._url(name)
        made = retried(
            lambda: self.store.fs.call_s3(
                "create_multipart_upload",
                Bucket=self.bucket,
                Key=self._key(name),
                ChecksumAlgorithm="CRC32",
            ),
            url,
            writing=True,
        )
        return made["UploadId"]

    def _complete(self, name: str, upload_id: str, parts: list[dict]) -> None:
        retried(
            lambda: self.store.fs.call_s3(
                "complete_multipart_upload",
                Bucket=self.bucket,
                Key=self._key(name),
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
            ),
            self._url(name),
            writing=True,
        )
        self.completed = True

    def _send_part(self, name: str, file: _File, number: int, offset: int, length: int) -> dict:
        """Send part ``number`` (bytes [offset, offset + length) of ``file``), read and checksummed at each try."""
        upload_id = file.created.result()  # type: ignore[union-attr]
        fd = file.fd
        assert fd is not None

        def send() -> dict:
            data, crc = _read_part(fd, offset, length)
            sent = self.store.fs.call_s3(
                "upload_part",
                Bucket=self.bucket,
                Key=self._key(name),
                UploadId=upload_id,
                PartNumber=number,
                Body=data,
                ChecksumAlgorithm="CRC32",
                ChecksumCRC32=crc,
            )
            return {"ETag": sent["ETag"], "ChecksumCRC32": crc}

        done = retried(send, self._url(name), writing=True)
        if self.drop_sent:
            punch_hole(fd, offset, length)
        return done

    def _put_whole(self, name: str, file: _File) -> dict:
        """Send ``file`` as one PUT, with its CRC-32."""
        fd, size = file.fd, file.size
        assert fd is not None and size is not None

        def send() -> dict:
            data, crc = _read_part(fd, 0, size)
            self.store.fs.call_s3(
                "put_object",
                Bucket=self.bucket,
                Key=self._key(name),
                Body=data,
                ChecksumAlgorithm="CRC32",
                ChecksumCRC32=crc,
            )
            return {}

        file.sent = size
        done = retried(send, self._url(name), writing=True)
        self.completed = True
        return done

    def _close(self, cancel: bool = False) -> None:
        """Stop the pool: with ``cancel``, parts not started are dropped; wait for those running."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=cancel)
            self._pool = None


_STREAMS: dict[str, Uploads] = {}
"""Uploads by the local directory DST is written in during the fill (``stream_into``)."""


def stream_into(root: Path, uploads: Uploads | None) -> None:
    """Have the files written under ``root`` (DST's staging path) sent by ``uploads`` as they are written; None: no more."""
    key = os.path.abspath(root)
    if uploads is None:
        _STREAMS.pop(key, None)
    else:
        _STREAMS[key] = uploads


def stream_of(root: Path) -> tuple[Uploads, str] | None:
    """Return the uploads files under ``root`` are sent by while written, and ``root``'s name under DST ('' for DST itself)."""
    here = os.path.abspath(root)
    for key, uploads in _STREAMS.items():
        if here == key or here.startswith(key + os.sep):
            return uploads, Path(os.path.relpath(here, key)).as_posix().removeprefix(".")
    return None
