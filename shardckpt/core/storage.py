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
``.metadata``); a marker object beside DST (``.NAME.shardckpt-partial``) says a run is
writing it, so the next run knows what it finds there for a killed run's leftovers
(``clear_leftovers``) and aborts its open multipart uploads.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import posixpath
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from shardckpt.core.errors import (
    BadInputError,
    DestinationExistsError,
    IOFailure,
    ShardckptError,
    UsageError,
    in_chain,
    notice,
)
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

RANK_FILE = re.compile(r"(?:[^/]*?[_-])?rank[_-]?\d+(?:[_-]of[_-]\d+)?\.(?:pt|pth)")
"""A per-rank ``torch.save`` file at the top of a directory SRC (``rank_3.pt``, ``model_rank3.pt``,
``rank3-of-4.pt``), read where it lies: the readers of per-rank files (``fsdp2-ranks``,
``fsdp1-sharded``, ``fsdp1-local``) load it on the meta device and read rows by ranges
(``torch_save.in_place``). veRL's ``*_world_size_N_rank_R.pt`` are not among them (its
flat optimizer state is loaded whole): fetched whole."""

DEEPSPEED_FILE = re.compile(
    r"(?:[^/]+/)?(?:bf16_|fp16_)?(?:zero_pp_rank_\d+_)?mp_rank_\d+_(?:model|optim)_states\.pt"
)
"""A DeepSpeed save's model- or optimizer-states file, in SRC or in its tag directory
(``global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt``), read where it lies: the
DeepSpeed reader loads it on the meta device and reads its flat partitions by ranges
(``torch_save.in_place``)."""

TORCH_CHECKPOINTING_METADATA = "metadata.pkl"
"""The file that makes a directory torch_checkpointing's: the ``.safetensors`` files at
its top (an item saved with ``SafetensorsSerialization``) are read where they lie, by
``pread`` (``safetensors_file.read_rows``); its ``.pt`` items are fetched whole."""

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
    them, and no object under it is a trainer's data: ``TRAINER_DATA``); a directory's
    per-rank ``torch.save`` files (``RANK_FILE``), DeepSpeed's states files
    (``DEEPSPEED_FILE``) and torch_checkpointing's ``*.safetensors`` items. Every other
    object is fetched whole.
    """
    if set(objects) == {""}:
        return [""] if store.name.endswith(ONE_FILE_READ_IN_PLACE) else []
    hf = not any(name.endswith(TRAINER_DATA) for name in objects)
    torch_checkpointing = TORCH_CHECKPOINTING_METADATA in objects
    return [
        name
        for name in objects
        if name.endswith(READ_WHERE_THEY_LIE)
        or ((hf or torch_checkpointing) and "/" not in name and name.endswith(HF_READ_IN_PLACE))
        or (RANK_FILE.fullmatch(name) and "world_size" not in name)
        or DEEPSPEED_FILE.fullmatch(name)
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
    uploads = [u for u in listing(bucket) if u.get("Key", "").startswith(key)]
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


def put_data(local: Path, store: Store, names: Sequence[str]) -> None:
    """Upload the data files ``names`` of ``local`` (several at once; each large one as a multipart upload)."""
    _put(local, store, names)


def commit(local: Path, store: Store, last: Sequence[str]) -> None:
    """Upload the commit files ``last`` (once every data file is uploaded), then remove the marker.

    Once it starts, a signal waits until DST is committed (then exit 0).
    """
    with committing(f"'{store.url}'"):
        _put(local, store, last)
        retried(lambda: store.fs.rm(_marker(store)), store.url, writing=True)


def abort(store: Store) -> None:
    """Abort DST's open multipart uploads, best effort (the next run aborts what is left)."""
    with contextlib.suppress(Exception):
        _abort_uploads(store)


def upload(
    local: Path,
    store: Store,
    commits: Sequence[str],
    *,
    overwrite: bool,
    rank: int = 0,
    world_size: int = 1,
    agreed: Callable[[Callable[[], object]], object] = lambda step: step(),
) -> None:
    """Upload the complete output ``local`` to DST, the objects named ``commits`` last.

    A marker beside DST is put first and removed last, by rank 0. Each of ``world_size``
    processes uploads its ``share`` of the data files; the commit objects go once every
    share is up. Under torchrun ``agreed`` is the runtime's (each step ends on every rank
    together; a failure on one is every rank's). A failure aborts the open multipart
    uploads and leaves no commit object; the next run clears the rest (``clear_leftovers``).
    """
    reopened()  # the local output was only DST's stand-in: a signal stops the upload
    first, last = split(local, commits)
    try:
        agreed(lambda: rank == 0 and begin_upload(store, overwrite=overwrite))
        agreed(lambda: put_data(local, store, share(first, rank, world_size)))
        agreed(lambda: rank == 0 and commit(local, store, last))
    except BaseException:
        abort(store)
        raise


def _put(local: Path, store: Store, names: Sequence[str]) -> None:
    """Upload ``names`` under ``local`` (``""``: the file ``local`` itself), several at a time.

    One request for the filesystem (s3fs sends the files side by side, each large one as a
    multipart upload); a failure names the object when there is one, else DST.
    """
    if not names:
        return
    sources = [str(local / name) if name else str(local) for name in names]
    targets = [store.child(name) if name else store.path for name in names]
    url = store.url if len(names) > 1 or not names[0] else f"{store.url}/{names[0]}"
    bounded = UPLOAD_BOUNDS if "s3" in _protocols(store.fs) else {}
    retried(lambda: store.fs.put(sources, targets, **bounded), url, writing=True)


UPLOAD_BOUNDS = {"batch_size": 2, "chunksize": 16 << 20, "max_concurrency": 4}
"""How s3fs uploads DST: 2 files at once, each over 32 MiB in 16 MiB parts, 4 in flight per
file: at most 128 MiB of parts in memory (its defaults, 50 MiB parts, 10 in flight per
file and every file at once, held 2 GiB for a 1 GB DST)."""


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = getattr(fs, "protocol", ())
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)
