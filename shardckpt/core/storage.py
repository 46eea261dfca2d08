"""Checkpoints on object storage: URLs, the fsspec filesystem behind each, and what its errors mean.

A SRC or DST written ``PROTOCOL://...`` (``s3://bucket/prefix``, ``gs://``, ``az://``,
``memory://``; ``file://`` is a local path) is reached through fsspec; the implementation
of each protocol is an optional extra (``shardckpt[s3]`` installs s3fs). Credentials and
endpoints come from the store's own environment and configuration (``AWS_ENDPOINT_URL``,
``AWS_PROFILE``, ...), never from the command line; ``--storage-option KEY=VALUE`` passes
the rest to the filesystem.

Every request is retried a bounded number of times with backoff (``RETRIES``); then the
failure is one line naming the object. A URL SRC is listed and laid out here (``lay_out``:
small objects fetched, data objects read where they lie, ``read_in_place``); a URL DST is
written by ``core/uploads.py``.
"""

from __future__ import annotations

import errno
import json
import os
import posixpath
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from shardckpt.core.errors import (
    BadInputError,
    IOFailure,
    ShardckptError,
    UsageError,
    in_chain,
)

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


def on_s3(store: Store) -> bool:
    """Return whether ``store`` is S3 reached through s3fs: its client's calls (``call_s3``) are ours to make."""
    protocol = getattr(store.fs, "protocol", ())
    protocols = (protocol,) if isinstance(protocol, str) else tuple(protocol)
    return "s3" in protocols and hasattr(store.fs, "call_s3")


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

RANK_FILE = re.compile(r"(?:[^/]*?rank[_-]?\d+(?:[_-]of[_-]\d+)?|__\d+_0)\.(?:pt|pth|bin)")
"""A per-rank ``torch.save`` file at the top of a directory SRC, by every name the readers
of per-rank files take (``formats/ranks/rank_names.py``: ``rank_3.pt``, ``model_rank3.pt``,
``rank3-of-4.pt``, ``__3_0.pt``, ``.pth``, ``.bin``), read where it lies: those readers
(``fsdp2-ranks``, ``fsdp1-sharded``, ``fsdp1-local``) load it on the meta device and read
rows by ranges (``torch_save.in_place``). accelerate's per-rank ``*_rank3.bin`` are such
names too: its reader refuses them by name, reading none. Of veRL's ``*_world_size_N_rank_R.pt`` the model and optimizer
files (``VERL_FILE``) are read in place too, its ``extra_state`` files (carried: copied as
they are) fetched whole."""

VERL_FILE = re.compile(r"(?:model|optim)_world_size_\d+_rank_\d+\.pt")
"""A veRL model or optimizer file: read as ``fsdp2-ranks`` or ``fsdp1-sharded`` read their rank
files, an FSDP1 save's optimizer files by ``flat_optim`` (loaded on the meta device too, each
rank's slices read by ranges)."""

DEEPSPEED_FILE = re.compile(
    r"(?:[^/]+/)?(?:bf16_|fp16_)?(?:zero_pp_rank_\d+_)?mp_rank_\d+_(?:model|optim)_states\.pt"
)
"""A DeepSpeed save's model- or optimizer-states file, in SRC or in its tag directory
(``global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt``), read where it lies: the
DeepSpeed reader loads it on the meta device and reads its flat partitions by ranges
(``torch_save.in_place``)."""

UNIVERSAL_FILE = re.compile(r"(?P<tag>(?:[^/]+/)?)zero/(?:[^/]+/[^/]+|optimizer_state)\.pt")
"""A DeepSpeed universal checkpoint's per-parameter file (``zero/<param>/fp32.pt``,
``exp_avg.pt``, ...) or its ``zero/optimizer_state.pt``, in SRC or in its tag directory,
read where it lies when ``zero/optimizer_state.pt`` lies beside (in that directory): the
``deepspeed-universal`` reader loads each on the meta device and reads the rows a rank
copies by ranges (``torch_save.in_place``)."""

TORCH_CHECKPOINTING_METADATA = "metadata.pkl"
"""The file that makes a directory torch_checkpointing's: the ``.safetensors`` files at
its top (an item saved with ``SafetensorsSerialization``) are read where they lie, by
``pread`` (``safetensors_file.read_rows``), and so are its ``.pt`` items
(``TORCH_CHECKPOINTING_ITEM``), loaded on the meta device (``torch_save.in_place``)."""

TORCH_CHECKPOINTING_ITEM = re.compile(r"[^/]+_\d+\.pt")
"""A torch_checkpointing item's ``torch.save`` file, ``<item>_<rank>.pt``."""

TRAINER_DATA = (".pt", ".pth", ".bin", ".pkl", ".ckpt", ".distcp", ".metadata")
"""Objects that make a directory of ``.safetensors`` a trainer's, whose readers map them: fetched whole."""

HF_TRAINER_STATE = re.compile(
    r"optimizer\.(?:pt|bin)|scheduler\.pt|scaler\.pt|rng_state(?:_\d+)?\.pth|training_args\.bin"
    r"|pytorch_model_fsdp\.bin"
)
"""What a transformers Trainer saves beside the model at the top of its ``checkpoint-N/``
(the names ``formats/hf/sharded.py`` carries unread): not trainer data, so its
``*.safetensors`` are read in place as an hf directory's are."""

HF_TRAINER_MARK = "trainer_state.json"
"""The object that makes an hf directory a Trainer's ``checkpoint-N/``."""

HF_TRAINER_UNREAD = re.compile(r"optimizer\.(?:pt|bin)|pytorch_model_fsdp\.bin")
"""A Trainer's optimizer state (Adam's: twice the model; ``optimizer.bin`` when it trained
under FSDP with full state dicts, beside FSDP's copy of the model, ``pytorch_model_fsdp.bin``),
which the hf reader carries unread: stand-ins, so none of their bytes is fetched (``verify``
reads them by ranges). Any other reader of them reads them through ``core.files``
(``--from accelerate`` reads ``.bin`` files with its ``torch.save`` reader and copies a
carried ``optimizer.pt`` with ``core.copies``: each reads a stand-in from the store)."""

ACCELERATE_RNG = re.compile(r"random_states_\d+\.pkl")
"""What every ``Accelerator.save_state`` writes (one per rank): the mark of its directory."""

ACCELERATE_DATA = re.compile(
    r"(?:(?:pytorch_model_fsdp|pytorch_model|model)(?:_\d+)?\.(?:bin|safetensors))"
    r"|optimizer(?:_\d+)?\.bin"
)
"""An accelerate directory's model and optimizer files (``formats/trainers/accelerate_names.py``),
read where they lie: its reader reads them with the safetensors and torch.save readers
(``SafetensorsReader``, ``TorchReader``), which read a stand-in through ``core.files``.
Its ``scheduler.bin``, ``dl_state_dict.bin``, ``scaler.pt`` and carried files are fetched."""


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
    them, and no object under it is a trainer's data, ``TRAINER_DATA``, but a Trainer's
    state beside them: ``HF_TRAINER_STATE``), and a Trainer's optimizer and FSDP model
    files (``HF_TRAINER_UNREAD``), never read; an accelerate directory's model and optimizer files (``ACCELERATE_DATA``); a directory's
    per-rank ``torch.save`` files (``RANK_FILE``, veRL's model and optimizer files), DeepSpeed's states files
    (``DEEPSPEED_FILE``), a universal checkpoint's files (``UNIVERSAL_FILE``) and
    torch_checkpointing's items (``*.safetensors``, ``<item>_<rank>.pt``). Every other object
    is fetched whole.
    """
    if set(objects) == {""}:
        return [""] if store.name.endswith(ONE_FILE_READ_IN_PLACE) else []
    hf = not any(
        name.endswith(TRAINER_DATA) and not HF_TRAINER_STATE.fullmatch(name) for name in objects
    )
    hf_trainer = hf and HF_TRAINER_MARK in objects
    torch_checkpointing = TORCH_CHECKPOINTING_METADATA in objects
    accelerate = any(ACCELERATE_RNG.fullmatch(name) for name in objects)
    return [
        name
        for name in objects
        if name.endswith(READ_WHERE_THEY_LIE)
        or ((hf or torch_checkpointing) and "/" not in name and name.endswith(HF_READ_IN_PLACE))
        or (torch_checkpointing and TORCH_CHECKPOINTING_ITEM.fullmatch(name))
        or (hf_trainer and HF_TRAINER_UNREAD.fullmatch(name))
        or (accelerate and ACCELERATE_DATA.fullmatch(name))
        or (RANK_FILE.fullmatch(name) and "world_size" not in name)
        or VERL_FILE.fullmatch(name)
        or DEEPSPEED_FILE.fullmatch(name)
        or _universal(name, objects)
    ]


def _universal(name: str, objects: dict[str, int]) -> bool:
    """Return whether ``name`` is a file of a universal checkpoint among ``objects`` (``UNIVERSAL_FILE``)."""
    found = UNIVERSAL_FILE.fullmatch(name)
    return found is not None and f"{found['tag']}zero/optimizer_state.pt" in objects


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
