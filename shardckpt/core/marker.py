"""The marker beside a URL DST (``.NAME.shardckpt-partial``): which run writes DST, and the lock between machines.

A run puts the marker before its first upload and removes it once DST is committed, so
the next run knows what it finds at DST for a killed run's leftovers (``core/uploads.py``).
Where the store has conditional writes (S3: ``If-None-Match: *`` and ``If-Match: ETAG`` on
PutObject), the marker is also the lock between machines, held as a lease:

1) (coordinator, before DST is checked) ``take``: the marker is created only where there is
   none; one that is there names its run (host, pid, start, heartbeat: JSON). A run that
   is alive refuses this one, exit 4; a dead one (on this host, with no such process; or
   not heard from for ``STALE_S``, or ended) is replaced, only if its marker did not
   change since it was read, and what it left is the caller's to clear.
2) (a thread of the holder) every ``HEARTBEAT_S`` the heartbeat is put again, only over
   the holder's own marker (its ETag).
3) (coordinator) ``confirm`` before the commit: the marker is still this run's; then
   ``release`` removes it. ``let_go`` at the end of a failed run: removed when nothing was
   sent, else marked ended, so the next run clears what is left at once, from any host.

Other stores (``memory://``, ``gs://``, ``az://``) get a plain marker with no owner, put
when the uploads begin and removed at the commit: runs on different machines are not kept
apart there. Held leases are kept here by marker, as ``stream_into`` keeps its uploads.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from shardckpt.core.destination import written_by_another
from shardckpt.core.errors import IOFailure
from shardckpt.core.storage import Store, on_s3, retried

HEARTBEAT_S = 30.0
"""How often the holder puts its marker's heartbeat again."""
STALE_S = 300.0
"""How old a heartbeat makes a marker a dead run's, from any host (10 heartbeats missed)."""
_TRIES = 3
"""How many times ``take`` reads and puts again when another run changed the marker meanwhile."""


def path(store: Store) -> str:
    """Return the marker's path: ``.NAME.shardckpt-partial`` beside DST."""
    return store.beside(f".{store.name}.shardckpt-partial")


def conditional(store: Store) -> bool:
    """Return whether DST's store takes conditional writes through its filesystem (S3, through s3fs)."""
    return on_s3(store)


@dataclass(frozen=True)
class Owner:
    """The run a marker names: what its body holds."""

    host: str
    pid: int
    started: float
    heartbeat: float
    """When the run last put its marker (its own clock); 0: the run ended."""

    def body(self) -> bytes:
        return json.dumps(self.__dict__).encode()

    def text(self) -> str:
        """Return the owner as a line says it: ``pid 4242 on node-7, since 2026-11-29 07:40:12 UTC, ...``."""
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started))
        heard = f"heartbeat {max(0, round(time.time() - self.heartbeat))} s ago"
        return (
            f"pid {self.pid} on {self.host}, since {since}, {heard if self.heartbeat else 'ended'}"
        )

    def dead(self) -> bool:
        """Return whether the run is gone: it ended, it is not heard from, or its process is not on this host."""
        if time.time() - self.heartbeat > STALE_S:
            return True
        if self.host != socket.gethostname():
            return False
        if self.pid == os.getpid():  # a run of this process that ended (its lease is let go)
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # another user's process
            return False
        return False


def _owner(body: bytes) -> Owner | None:
    """Return the run a marker's body names; None for a body that names none (an older shardckpt put an empty one)."""
    try:
        fields = json.loads(body)
        return Owner(
            str(fields["host"]),
            int(fields["pid"]),
            *map(float, (fields["started"], fields["heartbeat"])),
        )
    except (ValueError, TypeError, KeyError):
        return None


def _answer(exc: BaseException) -> tuple[int | None, str | None]:
    """Return the HTTP status and error code of a failed request, where it says them."""
    for error in (exc, exc.__cause__):
        response = getattr(error, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return status, response.get("Error", {}).get("Code")
    return None, None


class Lease:
    """This run's marker on an S3 DST: its ETag, and the thread that keeps its heartbeat fresh."""

    def __init__(self, store: Store, owner: Owner, etag: str):
        self.store = store
        self.owner = owner
        self.etag = etag
        self.lost = False
        """Whether another run replaced the marker (this run was judged dead): it must not commit."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="shardckpt-marker", daemon=True)
        self._thread.start()

    def refresh(self) -> bool:
        """Put the heartbeat again over this run's marker; return False (and stay lost) where it is not this run's any more."""
        with self._lock:
            if self.lost:
                return False
            owner = replace(self.owner, heartbeat=time.time())
            etag = _put(self.store, owner, IfMatch=self.etag)
            if etag is None:
                self.lost = True
                return False
            self.owner, self.etag = owner, etag
            return True

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if not self.refresh():
                    return
            except Exception:  # the store did not answer: the next beat tries again
                continue

    def stop(self) -> None:
        """Stop the heartbeat."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()


_held: dict[str, Lease] = {}


def _put(store: Store, owner: Owner, **condition: str) -> str | None:
    """Put ``owner`` as DST's marker under ``condition``; return its ETag, or None where the store refused it."""
    bucket, _, key = path(store).partition("/")
    try:
        sent = store.fs.call_s3(
            "put_object", Bucket=bucket, Key=key, Body=owner.body(), **condition
        )
    except Exception as exc:
        status, code = _answer(exc)
        if status == 412 or code in ("PreconditionFailed", "NoSuchKey"):
            return None  # another run's marker is there, or none is (If-Match)
        if status == 501 and condition:  # a store without the condition: put as before
            return _put(store, owner)
        raise
    return sent["ETag"]


def _read(store: Store) -> tuple[bytes, str] | None:
    """Return DST's marker's body and ETag (one GET), or None where there is none."""
    from fsspec.asyn import sync

    fs: Any = store.fs
    bucket, _, key = path(store).partition("/")

    async def get() -> tuple[bytes, str]:
        got = await fs._call_s3("get_object", Bucket=bucket, Key=key)
        try:
            return await got["Body"].read(), got["ETag"]
        finally:
            got["Body"].close()

    try:
        return sync(fs.loop, get)
    except FileNotFoundError:
        return None


def take(store: Store) -> str | None:
    """Hold DST's marker for this run (S3); return None where there was none, else who left it ("": unnamed).

    Raise exit 4 where a live run holds it.
    """
    now = time.time()
    mine = Owner(socket.gethostname(), os.getpid(), now, now)
    for _ in range(_TRIES):
        found = retried(lambda: _read(store), store.url, writing=True)
        previous = None  # no marker: nothing left to clear
        condition = {"IfNoneMatch": "*"}
        if found is not None:
            owner = _owner(found[0])
            if owner is not None and not owner.dead():
                raise written_by_another(owner.text(), store.url)
            previous = owner.text() if owner is not None else ""
            condition = {"IfMatch": found[1]}  # only the marker judged dead
        etag = retried(partial(_put, store, mine, **condition), store.url, writing=True)
        if etag is not None:
            _held[path(store)] = Lease(store, mine, etag)
            return previous
    raise IOFailure(
        f"its marker {path(store).rpartition('/')[2]!r} changed {_TRIES} times while it was taken",
        path=store.url,
        hint="another shardckpt run is starting on it: wait for it to finish, or write to another DST",
    )


def held(store: Store) -> bool:
    """Return whether this process holds DST's marker (``take``)."""
    return path(store) in _held


def lost(store: Store) -> bool:
    """Return whether another run took DST's marker over from this one: what is at DST is that run's."""
    lease = _held.get(path(store))
    return lease is not None and lease.lost


def confirm(store: Store) -> None:
    """Raise exit 4 unless DST's marker is still this run's (put again, over its ETag): before the commit."""
    lease = _held.get(path(store))
    if lease is not None and not retried(lease.refresh, store.url, writing=True):
        raise IOFailure(
            "another shardckpt run took its marker over (a run not heard from for "
            f"{STALE_S:.0f} s is taken for dead), so this run did not commit",
            path=store.url,
            hint="check what that run writes there; run again once it is done, or write to another DST",
        )


def put(store: Store) -> None:
    """Put DST's marker where this run holds none (a store without conditional writes: empty, no owner)."""
    if not held(store):
        retried(lambda: store.fs.pipe_file(path(store), b""), store.url, writing=True)


def release(store: Store) -> None:
    """Remove DST's marker: the heartbeat stopped first."""
    lease = _held.pop(path(store), None)
    if lease is not None:
        lease.stop()
    retried(lambda: store.fs.rm(path(store)), store.url, writing=True)


def let_go(store: Store, *, sent: bool) -> None:
    """Give DST's marker up at the end of a run that did not commit: removed unless it ``sent`` anything, else marked ended.

    Best effort: a marker left with its heartbeat is a dead run's to the next one (after
    ``STALE_S`` from another host).
    """
    lease = _held.pop(path(store), None)
    if lease is None:
        return
    lease.stop()
    with contextlib.suppress(Exception):
        if lease.lost:
            return
        if not sent:
            store.fs.rm(path(store))
        else:
            _put(store, replace(lease.owner, heartbeat=0.0), IfMatch=lease.etag)
