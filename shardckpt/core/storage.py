"""Checkpoints on object storage: URLs, the fsspec filesystem behind each, and what its errors mean.

A SRC or DST written ``PROTOCOL://...`` (``s3://bucket/prefix``, ``gs://``, ``az://``,
``memory://``; ``file://`` is a local path) is reached through fsspec; the implementation
of each protocol is an optional extra (``shardckpt[s3]`` installs s3fs). Credentials and
endpoints come from the store's own environment and configuration (``AWS_ENDPOINT_URL``,
``AWS_PROFILE``, ...), never from the command line; ``--storage-option KEY=VALUE`` passes
the rest to the filesystem.

Every request is retried a bounded number of times with backoff (``RETRIES``); then the
failure is one line naming the object. A DST is committed last (``upload``): every data
object first, then the objects a reader takes as the checkpoint's commit (DCP's
``.metadata``), S3's data objects as multipart uploads whose parts carry their CRC-32
(``Uploads``; a file job's parts sent while the fill writes it, ``stream_into``); a
marker object beside DST (``.NAME.shardckpt-partial``) says a run is
writing it, so the next run knows what it finds there for a killed run's leftovers
(``clear_leftovers``) and aborts its open multipart uploads.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import errno
import json
import os
import posixpath
import re
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from isal import isal_zlib

from shardckpt.core.errors import (
    BadInputError,
    DestinationExistsError,
    IOFailure,
    ShardckptError,
    UsageError,
    in_chain,
    notice,
)
from shardckpt.core.libc import linux_call
from shardckpt.core.signals import committing, reopened

_URL = re.compile(r"^(?P<protocol>[A-Za-z][A-Za-z0-9+.-]*)://(?P<rest>.*)$")

EXTRAS = {"s3": "s3", "s3a": "s3"}
"""The shardckpt extra that installs a protocol's fsspec implementation."""
_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs"}
_PACKAGES |= {"abfs": "adlfs", "hf": "huggingface_hub"}

RETRIES = 4
"""How many times a failed request is tried again (after 0.5, 1, 2, 4 s) before the run stops."""

T = TypeVar("T")


def is_url(text: str | os.PathLike) -> bool:
    """Return whether ``text`` is a URL (``s3://b/x``) rather than a local path (``file://`` is one)."""
    if not isinstance(text, str) or (found := _URL.match(text)) is None:
        return False
    return found.group("protocol").lower() != "file"


def local_form(text: str | os.PathLike) -> str | os.PathLike:
    """Return ``text`` with a ``file://`` URL turned into the local path it names."""
    if isinstance(text, str) and text.startswith("file://"):
        return text[len("file://") :] or "/"
    return text


def parse_options(pairs: Iterable[str]) -> dict[str, Any]:
    """Return ``--storage-option KEY=VALUE`` pairs as keyword arguments of the filesystem.

    A value that reads as JSON (``true``, ``8``, ``{"a": 1}``) is taken as such, any other
    as a string; ``a.b=V`` sets ``{"a": {"b": V}}`` (``client_kwargs.region_name=...``).
    """
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise UsageError(
                f"--storage-option {pair!r} is not KEY=VALUE",
                hint="write it like --storage-option anon=true",
            )
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        *parents, last = key.split(".")
        here = options
        for part in parents:
            here = here.setdefault(part, {})
            if not isinstance(here, dict):
                raise UsageError(f"--storage-option {pair!r} sets a key inside a value")
        here[last] = value
    return options


@dataclass(frozen=True)
class Store:
    """One URL and the filesystem that reaches it."""

    url: str
    """The URL as the user wrote it, without a trailing slash."""
    fs: Any
    """The fsspec filesystem."""
    path: str
    """The URL in the filesystem's own form (``bucket/prefix`` for S3)."""

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)

    def child(self, name: str) -> str:
        return f"{self.path}/{name}"

    def beside(self, name: str) -> str:
        """Return the path of ``name`` in the prefix DST lies in."""
        return posixpath.join(posixpath.dirname(self.path), name)


def open_store(url: str, options: dict[str, Any]) -> Store:
    """Return the ``Store`` of ``url``; one line when its protocol has no implementation here."""
    protocol = _URL.match(url).group("protocol").lower()  # type: ignore[union-attr]
    package = _PACKAGES.get(protocol)
    extra = EXTRAS.get(protocol)
    how = f"pip install 'shardckpt[{extra}]'" if extra else f"pip install {package or 'fsspec'}"
    try:
        import fsspec

        cls = fsspec.get_filesystem_class(protocol)
    except ImportError:
        raise UsageError(
            f"reading and writing {protocol}:// needs {package or 'its fsspec implementation'}, "
            "which is not installed",
            path=url,
            hint=f"install it ({how})",
        ) from None
    except ValueError:
        raise UsageError(
            f"{protocol}:// is not a protocol fsspec knows",
            path=url,
            hint="write a local path, or a URL such as s3://bucket/prefix",
        ) from None
    try:
        fs = cls(**options)
    except TypeError as exc:
        raise UsageError(
            f"a --storage-option does not apply to {protocol}:// ({exc})",
            path=url,
            hint="pass only options its filesystem takes",
        ) from None
    path = cls._strip_protocol(url).rstrip("/")
    if not path:
        raise UsageError("names no bucket", path=url, hint="write it as s3://bucket/prefix")
    if any(part in (".", "..") for part in path.split("/")):
        raise UsageError(
            "has '.' or '..' in its path, which object stores take as part of a name",
            path=url,
            hint="write the prefix itself",
        )
    return Store(url.rstrip("/"), fs, path)


def _status(exc: BaseException) -> str:
    """Return the HTTP status (or error code) of a failed request, when it says one."""
    response = getattr(exc, "response", None) or getattr(exc.__cause__, "response", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return " ".join(str(x) for x in (status, code) if x)
    return ""


def store_error(exc: BaseException, url: str, *, writing: bool = False) -> ShardckptError:
    """Return the one-line error for ``exc``, raised by a request for ``url``."""
    status = _status(exc)
    said = f" ({status})" if status else ""
    if isinstance(exc, FileNotFoundError) or getattr(exc, "errno", None) == errno.ENOENT:
        if writing:
            return IOFailure(
                f"no such bucket{said}",
                path=url,
                hint="create the bucket first, or check the URL and AWS_ENDPOINT_URL",
            )
        return BadInputError(
            f"no such object or prefix{said}",
            path=url,
            hint="check the URL of the checkpoint (and the bucket's name)",
        )
    if isinstance(exc, PermissionError) or getattr(exc, "errno", None) in (
        errno.EACCES,
        errno.EPERM,
    ):
        return IOFailure(
            f"access denied{said}",
            path=url,
            hint="check the credentials in the environment (AWS_PROFILE, AWS_ACCESS_KEY_ID) "
            "and the bucket's policy",
        )
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
        return IOFailure(
            "no space left on the local disk for its copy",
            path=url,
            hint="free space in $TMPDIR, or point TMPDIR at a larger disk: a URL's checkpoint "
            "is copied there (docs/storage.md)",
        )
    if in_chain(exc, ConnectionError) is not None:
        return IOFailure(
            f"cannot reach the store ({text})",
            path=url,
            hint="check the endpoint (AWS_ENDPOINT_URL) and the network, and run again",
        )
    what = "writing" if writing else "reading"
    return IOFailure(
        f"{what} failed after {RETRIES + 1} tries ({status or text})",
        path=url,
        hint="check the endpoint (AWS_ENDPOINT_URL) and the network, and run again",
    )


def _final(exc: BaseException) -> bool:
    """Return whether trying ``exc``'s request again cannot help.

    A store that cannot be reached at all was tried again already, by the filesystem and
    its client (s3fs and botocore back off for 8 s): a wrong endpoint is said at once.
    """
    return (
        isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError))
        or getattr(exc, "errno", None)
        in (errno.ENOENT, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT)
        or in_chain(exc, ConnectionError) is not None
    )


def retried(request: Callable[[], T], url: str, *, writing: bool = False, pause: float = 0.5) -> T:
    """Return what ``request`` returns, tried again up to ``RETRIES`` times; else raise one line."""
    for attempt in range(RETRIES + 1):
        try:
            return request()
        except ShardckptError:
            raise
        except Exception as exc:
            if _final(exc) or attempt == RETRIES:
                raise store_error(exc, url, writing=writing) from None
            time.sleep(pause * 2**attempt)
    raise AssertionError("unreachable")


# ------------------------------------------------------------------ SRC


def local_name(store: Store, into: Path) -> Path:
    """Return the path ``download`` gives SRC's copy in the directory ``into``."""
    return into / (store.name or "src")


def download(store: Store, into: Path) -> Path:
    """Copy SRC (an object, or every object under a prefix) into the directory ``into``; return its path."""
    info = retried(lambda: store.fs.info(store.path), store.url)
    local = local_name(store, into)
    if info.get("type") == "directory":
        keys = retried(lambda: store.fs.find(store.path + "/"), store.url)
        names = [_object_name(store, key) for key in keys]
        local.mkdir()
        targets = [str(local / name) for name in names]
        retried(lambda: store.fs.get(keys, targets), store.url)
    else:
        retried(lambda: store.fs.get_file(store.path, str(local)), store.url)
    return local


READ_WHERE_THEY_LIE = (".distcp",)
"""The objects of a URL SRC that are not fetched: every reader of them reads through
``core.files`` (DCP's data files, in any directory: a trainer's DCP too), so a stand-in
(``core.remote_files``) reads their bytes from the store as they are needed."""

ONE_FILE_READ_IN_PLACE = (".safetensors", ".pt", ".pth", ".bin")
"""A SRC that is one object with such a name is read where it lies: the safetensors and
torch.save readers read a stand-in through ``core.files`` (``opened``'s ``RoutedFile``,
``torch_save.file.load`` through a stream), never through a mapping."""

HF_READ_IN_PLACE = ".safetensors"
"""The weights of a Hugging Face directory SRC (``save_pretrained``'s shards), read where they lie."""

TRAINER_DATA = (".pt", ".pth", ".bin", ".pkl", ".ckpt", ".distcp", ".metadata")
"""Objects that make a directory of ``.safetensors`` a trainer's, whose readers map them: fetched whole."""


def listing(store: Store) -> dict[str, int]:
    """Return the objects of SRC (a prefix) by name under it, with their sizes; ``{"": size}`` when SRC is one object."""
    info = retried(lambda: store.fs.info(store.path), store.url)
    if info.get("type") != "directory":
        return {"": int(info.get("size") or 0)}
    found = retried(lambda: store.fs.find(store.path + "/", detail=True), store.url)
    return {_object_name(store, key): int(entry.get("size") or 0) for key, entry in found.items()}


def read_in_place(store: Store, objects: dict[str, int]) -> list[str]:
    """Return which of SRC's ``objects`` (``listing``) are read where they lie, through stand-ins.

    DCP's data objects anywhere; SRC itself (``""``) when it is one safetensors or
    torch.save object; a Hugging Face directory's ``*.safetensors`` (its top level holds
    them, and no object under it is a trainer's data: ``TRAINER_DATA``). Every other
    object is fetched whole.
    """
    if set(objects) == {""}:
        return [""] if store.name.endswith(ONE_FILE_READ_IN_PLACE) else []
    hf = not any(name.endswith(TRAINER_DATA) for name in objects)
    return [
        name
        for name in objects
        if name.endswith(READ_WHERE_THEY_LIE)
        or (hf and "/" not in name and name.endswith(HF_READ_IN_PLACE))
    ]


def lay_out(store: Store, into: Path, objects: dict[str, int]) -> Path:
    """Lay SRC out in the directory ``into``: its small objects fetched, its data objects as stand-ins; return its path.

    ``objects``: ``listing(store)``. A data object (``read_in_place``) becomes an empty
    sparse file of its size, registered with ``core.remote_files`` by the caller; every
    other object is fetched whole. SRC that is one object is one file, a stand-in or fetched.
    """
    local = local_name(store, into)
    in_place = set(read_in_place(store, objects))
    if set(objects) == {""}:
        if not in_place:
            return download(store, into)
        with open(local, "xb") as f:
            f.truncate(objects[""])
        return local
    local.mkdir()
    fetched = [name for name in objects if name not in in_place]
    for name in objects:
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        if name in in_place:
            with open(local / name, "xb") as f:
                f.truncate(objects[name])
    if fetched:
        keys = [store.child(name) for name in fetched]
        targets = [str(local / name) for name in fetched]
        retried(lambda: store.fs.get(keys, targets), store.url)
    return local


def _object_name(store: Store, key: str) -> str:
    """Return the name of object ``key`` under SRC's prefix; refuse one that is no plain relative path.

    A key is any string: ``run/../../x`` or ``run//x`` would name a file outside SRC's
    copy, or none, on the local disk.
    """
    name = key[len(store.path) + 1 :]
    if any(part in ("", ".", "..") for part in name.split("/")):
        raise BadInputError(
            f"holds an object named '{name}', which names no file inside the checkpoint",
            path=store.url,
            hint="remove or rename that object; shardckpt reads only the objects under SRC",
        )
    return name


# ------------------------------------------------------------------ DST


def _marker(store: Store) -> str:
    return store.beside(f".{store.name}.shardckpt-partial")


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
        store.fs.call_s3(
            "abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"]
        )
    return len(uploads)


def clear_leftovers(store: Store, commits: Sequence[str]) -> None:
    """Remove what a killed run left at DST: its data objects (uncommitted), open uploads, its marker."""

    def clear() -> None:
        marker = _marker(store)
        if not store.fs.exists(marker):
            return
        found = [key[len(store.path) + 1 :] for key in _under(store)]
        committed = bool(commit_objects(found, commits))  # a commit began: never removed
        if not committed:
            found = _under(store)
            if found:
                store.fs.rm(found)
        aborted = _abort_uploads(store)
        store.fs.rm(marker)
        if not committed:
            notice(
                f"removed what a run that did not finish left at '{store.url}' "
                f"(uncommitted objects and {aborted} open uploads)"
            )

    retried(clear, store.url, writing=True)


def check_dst(store: Store, *, overwrite: bool) -> None:
    """Raise when DST holds objects and --overwrite was not given; a missing bucket is one line."""
    if store.fs.root_marker == "":  # an object store: the first part of a path is its bucket
        bucket, _, key = store.path.partition("/")
        if not key:
            raise UsageError(
                "names a whole bucket", path=store.url, hint="name a prefix inside it for DST"
            )
        if not retried(lambda: store.fs.exists(bucket), store.url, writing=True):
            raise store_error(FileNotFoundError(bucket), store.url, writing=True)
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


def _natural(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def share(names: Sequence[str], rank: int, world_size: int) -> list[str]:
    """Return the data files rank ``rank`` of ``world_size`` uploads: every ``world_size``-th, in natural order.

    A per-rank file of target rank r (DCP's ``__r_0.distcp``) was written by the process
    acting for it, process r mod N (``core.placement``): that process uploads it.
    """
    return sorted(names, key=_natural)[rank::world_size]


def begin_upload(store: Store, *, overwrite: bool) -> None:
    """Put the marker beside DST (the coordinator, before any rank uploads); with ``overwrite`` remove the old DST.

    No reader sees the old commit object over new data.
    """
    fs, marker = store.fs, _marker(store)
    retried(lambda: fs.pipe_file(marker, b""), store.url, writing=True)
    if overwrite and (old := retried(lambda: _under(store), store.url)):
        retried(lambda: fs.rm(old), store.url, writing=True)


def put_data(
    local: Path, store: Store, names: Sequence[str], uploads: Uploads | None = None
) -> None:
    """Upload the data files ``names`` of ``local`` (several at once; each large one as a multipart upload).

    With ``uploads`` (S3): through it, each part with its CRC-32, and every upload it holds
    (those streamed during the fill too) completed before returning.
    """
    if uploads is None:
        _put(local, store, names)
        return
    for name in names:
        path = local / name if name else local
        uploads.whole(name, path, path.stat().st_size)
    uploads.finish()


def commit(local: Path, store: Store, last: Sequence[str]) -> None:
    """Upload the commit files ``last`` (once every data file is uploaded), then remove the marker.

    One after another, in their order. Once it starts, a signal waits until DST is
    committed (then exit 0).
    """
    with committing(f"'{store.url}'"):
        for name in last:
            if checks_parts(store):
                put_data(local, store, [name], Uploads(store))
            else:
                _put(local, store, [name])
        retried(lambda: store.fs.rm(_marker(store)), store.url, writing=True)


def abort(store: Store) -> None:
    """Abort DST's open multipart uploads, best effort (the next run aborts what is left)."""
    with contextlib.suppress(Exception):
        _abort_uploads(store)


def abandon(store: Store) -> None:
    """Clear DST of a run that failed before any data object was complete: its open uploads, its marker (best effort)."""
    with contextlib.suppress(Exception):
        _abort_uploads(store)
        store.fs.rm(_marker(store))


def upload(
    local: Path,
    store: Store,
    commits: Sequence[str],
    *,
    overwrite: bool,
    rank: int = 0,
    world_size: int = 1,
    agreed: Callable[[Callable[[], object]], object] = lambda step: step(),
    uploads: Uploads | None = None,
    streamed: Collection[str] = (),
) -> None:
    """Upload the complete output ``local`` to DST, the objects named ``commits`` last.

    A marker beside DST is put first and removed last, by rank 0 (put already when
    ``uploads`` began during the fill, ``Uploads.begin``). Each of ``world_size`` processes
    uploads its ``share`` of the data files no rank ``streamed`` during the fill, and
    completes its own uploads; the commit objects go once every share is up. Under torchrun
    ``agreed`` is the runtime's (each step ends on every rank together; a failure on one is
    every rank's). A failure aborts the open multipart uploads and leaves no commit object;
    the next run clears the rest (``clear_leftovers``).
    """
    reopened()  # the local output was only DST's stand-in: a signal stops the upload
    first, last = split(local, commits)
    rest = [name for name in first if name not in streamed]
    begun = uploads is not None and uploads.begun
    try:
        agreed(lambda: rank == 0 and not begun and begin_upload(store, overwrite=overwrite))
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


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = getattr(fs, "protocol", ())
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


# ------------------------------------------------------------------ DST: parts with their CRC-32

PART_BYTES = 16 << 20
"""The size of an upload's parts (S3: at least 5 MiB but the last); a file up to this size is one PUT."""
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


_MOST_PARTS = 10_000  # S3's limit per upload


def checks_parts(store: Store) -> bool:
    """Return whether DST is uploaded by ``Uploads``: S3, whose parts carry a checksum the store checks."""
    return "s3" in _protocols(store.fs) and hasattr(store.fs, "call_s3")


def checksum(data) -> str:
    """Return the CRC-32 of ``data`` as S3 takes it (``ChecksumCRC32``): base64 of its 4 big-endian bytes."""
    return base64.b64encode(isal_zlib.crc32(data).to_bytes(4, "big")).decode()


def part_size(number: int) -> int:
    """Return the size of part ``number`` (from 1): 16 MiB, 16 MiB more every 1,000 parts.

    S3 takes 10,000 parts of an upload: so a file of up to 860 GiB, written before its size
    is known, fits.
    """
    return PART_BYTES * (1 + (number - 1) // 1000)


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


class Uploads:
    """This process's uploads to an S3 DST: each file a multipart upload, a part sent once its bytes are final.

    ``final(name, path, upto)``: the first ``upto`` bytes of DST's file ``name`` (the local
    file ``path``) will not change: each whole part among them is sent. ``whole(name,
    path, size)``: the file is complete: the rest goes, as its last part (a file that
    started no upload and holds at most one part goes as one PUT). Parts go
    ``PARTS_IN_FLIGHT`` at a time on threads of their own; a part waiting for a thread is
    only an offset, read from the file when it is sent. ``finish()`` waits for every part
    and completes each upload, ``abort()`` drops the parts not sent and aborts each upload
    opened. Every part and PUT carries the CRC-32 of its bytes (``ChecksumCRC32``), so the
    store refuses bytes that changed on the way (S3 answers 400 BadDigest: the part is
    read and sent again, ``RETRIES`` times).
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

    def finish(self) -> None:
        """Wait for every part sent; complete each upload (its parts' CRC-32s with it)."""
        try:
            for name, file in self._files.items():
                if file.size is None:
                    raise RuntimeError(f"internal: DST file {name!r} was streamed but never ended")
                done = [{"PartNumber": n, **part.result()} for n, part in file.parts]
                if file.created is None:
                    continue  # one PUT, done with its future
                self._complete(name, file.created.result(), done)
        finally:
            self._close()
        self._files.clear()

    def abort(self) -> None:
        """Drop the parts not sent, wait for those being sent, abort every upload opened (best effort)."""
        self._close(cancel=True)
        for name, file in self._files.items():
            created = file.created
            if created is None or not created.done() or created.cancelled():
                continue
            with contextlib.suppress(Exception):
                self.store.fs.call_s3(
                    "abort_multipart_upload",
                    Bucket=self.bucket,
                    Key=self._key(name),
                    UploadId=created.result(),
                )
        self._files.clear()

    # -- inside

    def _key(self, name: str) -> str:
        return (self.store.child(name) if name else self.store.path).partition("/")[2]

    def _url(self, name: str) -> str:
        return f"{self.store.url}/{name}" if name else self.store.url

    def _raise_failure(self) -> None:
        """Raise the first failure of a part sent: the fill stops at once, not after it."""
        if self._failed is not None:
            raise self._failed

    def _part(self, name: str, file: _File, length: int) -> None:
        """Hand the next ``length`` bytes of ``file`` to the pool as its next part; open its upload first."""
        if file.created is None:
            file.created = self._submit(file, self._create, name)
        number = len(file.parts) + 1
        if number > _MOST_PARTS:
            raise IOFailure(
                f"is larger than an upload of {_MOST_PARTS} parts takes",
                path=self._url(name),
                hint="write a DST with more, smaller files (a larger --world-size)",
            )
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
