"""SRC and DST given as URLs (``s3://bucket/prefix``): each command runs on local paths standing for them.

A URL SRC is laid out in a private temporary directory, once per node (by its lowest
rank; removed when the command ends): its data objects (``storage.read_in_place``: DCP's,
a safetensors or torch.save SRC, an hf directory's shards and a Trainer's optimizer,
accelerate's model and optimizer files, FSDP rank files, DeepSpeed's states files,
torch_checkpointing's safetensors items) as stand-ins that every rank
reads from the store by ranges (``core.remote_files``), its other objects fetched. A URL
DST is written under a staging directory on this node, named for the URL (so every rank
of a ``torchrun`` on one node writes the same one), and uploaded: each rank the data
files it wrote (on S3, a file written whole by one process part by part while the fill
writes it, ``core.uploads.Uploads``; the others after the fill, on S3 each one larger
than a part as one upload whose parts every rank sends), then the coordinator the commit
objects (``publish``). Errors and results
name the URLs, never the local paths standing for them.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import socket
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, TypeVar

from shardckpt.core import marker, remote_files, storage, uploads
from shardckpt.core.destination import written_by_another
from shardckpt.core.dist import Runtime
from shardckpt.core.errors import ShardckptError, UsageError
from shardckpt.core.lock import FileLock, LockBusy
from shardckpt.core.signals import sheltered
from shardckpt.state.choices import DEFAULT_BUFFER_BYTES

R = TypeVar("R")


def _rename(exc: BaseException, names: dict[str, str]) -> None:
    """Put the URL where ``exc``'s line (and notes) name a local path standing for it."""

    def swap(text: str | None) -> str | None:
        if text is None:
            return None
        for local, url in names.items():
            text = text.replace(local, url)
        return text

    if isinstance(exc, ShardckptError):
        exc.path, exc.message, exc.hint = swap(exc.path), swap(exc.message), swap(exc.hint)
        exc.args = (exc.line(),)
    notes = getattr(exc, "__notes__", None)
    if notes:
        exc.__notes__ = [swap(n) for n in notes]


def _named(value: R, names: dict[str, str]) -> R:
    """Return ``value`` (a result) with every string in it that names a local stand-in naming its URL."""
    if isinstance(value, str):
        for local, url in names.items():
            value = value.replace(local, url)  # type: ignore[assignment]
        return value
    if isinstance(value, list):
        return [_named(v, names) for v in value]  # type: ignore[return-value]
    if not hasattr(value, "__dataclass_fields__") or isinstance(value, type):
        return value
    changes = {f.name: _named(getattr(value, f.name), names) for f in fields(value) if f.init}  # type: ignore[arg-type]
    return replace(value, **changes)  # type: ignore[type-var]


def _staging(url: str) -> Path:
    """Return the directory a URL DST is written in on this node: the same for every rank of a run."""
    key = hashlib.sha256(url.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / "shardckpt-staging" / key


def _refuse_same(src: str, dst: str) -> None:
    a, b = src.rstrip("/"), dst.rstrip("/")
    if a == b or b.startswith(a + "/") or a.startswith(b + "/"):
        raise UsageError(
            "DST is SRC, inside it or around it",
            path=dst,
            hint="name a prefix beside the checkpoint for the output",
        )


def _clear_staged(staging: Path, name: str) -> None:
    """Remove what a killed run left in the URL's staging directory (its lock is this run's now).

    The next step says what it left at the URL; the local copy standing for it is private.
    """
    for leftover in (
        staging / name,
        *(staging / f".{name}.shardckpt-{k}" for k in ("partial", "old")),
    ):
        if leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()


class OnStorage:
    """The local paths a command runs on for the URLs of one request, and what is done with them."""

    def __init__(
        self,
        request: Any,
        runtime: Runtime,
        srcs: Sequence[str],
        dst: str | None,
        commits: Sequence[str],
    ):
        self.asked = request
        """The request as given, URLs and all."""
        self.request = request
        """The request the command runs: local paths standing for the URLs."""
        self.commits = commits
        """The objects of DST written last (the output format's ``commit_last``)."""
        self.runtime = runtime
        self.paths = [*srcs, *([dst] if dst else [])]
        """The request's fields that name a checkpoint."""
        self.srcs = [n for n in srcs if storage.is_url(getattr(request, n))]
        self.dst_url = (
            getattr(request, dst) if dst and storage.is_url(getattr(request, dst)) else None
        )
        self.dst_field = dst
        self.names: dict[str, str] = {}
        self.dst_store: storage.Store | None = None
        self.staged: Path | None = None
        self.partial: Path | None = None
        """Where the fill writes the staged DST (``core.destination``'s partial output)."""
        self.url_lock: FileLock | None = None
        self.uploads: uploads.Uploads | None = None
        """This process's uploads to DST (S3): file jobs' parts sent during the fill."""
        self.sent = False
        """Whether this process began uploading DST: what it leaves there is the next run's to clear."""
        self.fetched: Path | None = None
        """The node's stand-ins of the URL SRCs, on the rank that laid them out."""
        self.stand_ins: list[tuple[int, int]] = []
        """The stand-ins this process registered (``core.remote_files``)."""

    def local_request(self) -> Any:
        """Return the request on local paths: SRCs fetched, DST staged (and checked where it is)."""
        request, runtime = self.asked, self.runtime
        changes = {
            n: storage.local_form(getattr(request, n))
            for n in self.paths
            if isinstance(getattr(request, n), str)
        }
        if not self.srcs and not self.dst_url:
            return replace(request, **changes)
        options = runtime.agreed(lambda: storage.parse_options(request.storage_options))
        here = socket.gethostname()
        hosts = runtime.all_gather(here) if runtime.distributed else [here]
        if self.srcs:
            if self.dst_url:
                for n in self.srcs:
                    _refuse_same(getattr(request, n), self.dst_url)
            changes |= self._fetch(options, fetcher=hosts.index(here) == runtime.rank)
        if self.dst_url:
            changes[self.dst_field] = str(self._stage(options, nodes=len(set(hosts))))  # type: ignore[index]
            # The staged copy is this run's own: a leftover of a killed run is replaced.
            changes["overwrite"] = True
        return replace(request, **changes)

    def _fetch(self, options: dict[str, Any], *, fetcher: bool) -> dict[str, Path]:
        """Return the local stand-in of each URL SRC: one per node, laid out by ``fetcher`` (agreed).

        Its data objects are read where they lie (``core.remote_files``): each rank lists
        SRC once and registers the node's stand-ins once they exist; the rest of SRC's
        objects (metadata) are fetched whole, once per node.
        """
        token = uuid.uuid4().hex
        if self.runtime.distributed:
            token = self.runtime.broadcast(token)
        tmp = Path(tempfile.gettempdir()) / f"shardckpt-src-{token}"

        def fetch() -> dict[str, Path]:
            fetched = {}
            if fetcher:
                tmp.mkdir(mode=0o700)
                self.fetched = tmp
            for n in self.srcs:
                store = storage.open_store(getattr(self.asked, n), options)
                objects = storage.listing(store)
                if fetcher:
                    (tmp / n).mkdir()
                    storage.lay_out(store, tmp / n, objects)
                fetched[n] = storage.local_name(store, tmp / n)
                self.names[str(fetched[n])] = store.url
                laid[n] = (store, objects)
            return fetched

        laid: dict[str, tuple[storage.Store, dict[str, int]]] = {}
        fetched = self.runtime.agreed(fetch)

        def register() -> None:
            for n, (store, objects) in laid.items():
                for name in storage.read_in_place(store, objects):
                    url, key = (
                        (f"{store.url}/{name}", store.child(name))
                        if name
                        else (store.url, store.path)
                    )
                    obj = remote_files.RemoteObject(store.fs, key, url, objects[name])
                    self.stand_ins.append(remote_files.stand_in(fetched[n] / name, obj))

        self.runtime.agreed(register)  # once the node's stand-ins exist
        return fetched

    def _stage(self, options: dict[str, Any], *, nodes: int) -> Path:
        """Return where DST is staged on this node; take the URL's lock, clear leftovers, check DST (agreed)."""
        request, runtime = self.asked, self.runtime
        store = runtime.agreed(lambda: storage.open_store(self.dst_url, options))
        self.dst_store = store
        staging = _staging(store.url)
        self.staged = staging / store.name
        self.partial = staging / f".{store.name}.shardckpt-partial"
        self.names[str(self.partial)] = store.url
        self.names[str(self.staged)] = store.url

        def check() -> None:
            if nodes > 1:
                raise UsageError(
                    f"the ranks run on {nodes} nodes, and a URL DST is uploaded from one "
                    "node's staging copy",
                    path=self.dst_url,
                    hint="run the ranks on one node, or write DST to a shared filesystem",
                )
            if getattr(request, "dry_run", False):
                return  # nothing is written: DST is judged as a local one is, not at all
            staging.mkdir(parents=True, exist_ok=True)
            if runtime.coordinator:
                try:
                    self._lock(staging / f".{store.name}.shardckpt-url-lock")
                except FileNotFoundError:  # a run that just ended removed the directory
                    staging.mkdir(parents=True, exist_ok=True)
                    self._lock(staging / f".{store.name}.shardckpt-url-lock")
                _clear_staged(staging, store.name)
                uploads.check_bucket(store)
                uploads.clear_leftovers(store, self.commits)
                uploads.check_dst(store, overwrite=request.overwrite)

        runtime.agreed(check)
        if uploads.checks_parts(store) and not getattr(request, "dry_run", False):
            buffer = getattr(request, "buffer_bytes", DEFAULT_BUFFER_BYTES)
            self.uploads = uploads.Uploads(
                store,
                overwrite=request.overwrite,
                in_flight=uploads.parts_in_flight(buffer),
                # --verify reads the staged DST back: its bytes must stay until then.
                drop_sent=not getattr(request, "verify", False),
            )
            uploads.stream_into(self.partial, self.uploads)
        return self.staged

    def _lock(self, path: Path) -> None:
        """Hold the node's lock on the URL for the run: another run here would take our objects for leftovers.

        Runs on other machines are not seen here: on S3 the marker beside DST keeps them
        apart (``core/marker.py``); on other stores it tells what they left, not whether
        they still run.
        """
        lock = FileLock(path)
        try:
            with sheltered():
                lock.acquire(wait_s=1.0)
                self.url_lock = lock
        except LockBusy as busy:
            raise written_by_another(busy.owner, self.dst_url) from None

    def publish(self) -> None:
        """Upload the staged DST: each rank its share of the data files (on S3, its share of every large file's parts), then the coordinator the commit objects.

        Agreed at each step: the commit objects are put only once every rank's uploads
        are complete; a failure on any rank aborts the open multipart uploads.
        """
        if self.dst_store is None or self.staged is None or getattr(self.asked, "dry_run", False):
            return
        runtime = self.runtime
        # From here a failure is upload's to clean up: data objects may be complete.
        sending, self.uploads = self.uploads, None
        self.sent = True
        streamed = sending.streamed if sending is not None else []
        if runtime.distributed:  # every rank leaves out what any rank streamed
            streamed = [name for names in runtime.all_gather(streamed) for name in names]
        uploads.upload(
            self.staged,
            self.dst_store,
            self.commits,
            overwrite=self.asked.overwrite,
            rank=runtime.rank,
            world_size=runtime.world_size,
            agreed=runtime.agreed,
            all_gather=runtime.all_gather,
            uploads=sending,
            streamed=set(streamed),
        )

    def abandon(self) -> None:
        """Stop this process's uploads of a run that failed: parts not sent dropped, its open uploads aborted.

        Standalone, where the marker was put for them and no data object was completed, the
        marker goes too: nothing of the run is left at DST.
        """
        sending, self.uploads = self.uploads, None
        if sending is None or self.dst_store is None:
            return
        self.sent = sending.begun
        with sheltered(raising=False):
            sending.abort()
            if sending.begun and not self.runtime.distributed:
                uploads.abandon(self.dst_store)

    def done_reading(self) -> None:
        """Return once every rank is done with the node's copy of SRC (the fetcher removes it)."""
        if self.srcs and self.runtime.distributed:
            self.runtime.agreed(lambda: None)

    def cleanup(self) -> None:
        """Remove the node's stand-ins of SRC (on the rank that laid them out) and the staged DST."""
        remote_files.forget(self.stand_ins)
        if self.partial is not None:
            uploads.stream_into(self.partial, None)
        if self.fetched is not None:
            with sheltered(raising=False):
                shutil.rmtree(self.fetched, ignore_errors=True)
        self._unstage()

    def _unstage(self) -> None:
        """Remove the staged DST and give the locks back (the coordinator, when it took the lock): the marker's too, where it holds it."""
        if self.staged is None or self.url_lock is None:
            return  # another run's staged DST is not this run's to remove
        with sheltered(raising=False):
            if self.dst_store is not None:
                marker.let_go(self.dst_store, sent=self.sent)
            if self.staged.is_dir():
                shutil.rmtree(self.staged, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    self.staged.unlink()
            self.url_lock.release()
            with contextlib.suppress(OSError):
                self.staged.parent.rmdir()  # unless another run stages there now


@contextlib.contextmanager
def on_storage(
    request: Any,
    runtime: Runtime,
    srcs: Sequence[str] = ("src",),
    dst: str | None = None,
    commits: Sequence[str] = (),
) -> Iterator[OnStorage]:
    """Yield the run's ``OnStorage``; errors raised inside name the URLs, not the local paths."""
    run = OnStorage(request, runtime, srcs, dst, commits)
    try:
        run.request = run.local_request()
        yield run
        run.done_reading()
    except BaseException as exc:
        run.abandon()
        _rename(exc, run.names)
        raise
    finally:
        run.cleanup()


def named(result: R, run: OnStorage) -> R:
    """Return ``result`` naming the URLs where it names their local stand-ins."""
    return _named(result, run.names) if run.names else result
