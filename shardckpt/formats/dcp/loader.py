"""DCP's own loader over a checkpoint's files: values and the chunks ``StoredRows`` cannot place.

``DcpReader`` reads metadata and rows without torch; what only torch's loader reads
(a value whose pickle is not plain, a chunk not laid out row after row) comes here,
imported when first needed. Values are loaded ``weights_only``; every data file is
read through ``core.files`` and a failure names the file and the key being read.
"""

from __future__ import annotations

import io
import pickle
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    create_default_local_load_plan,
)
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.futures import Future

from shardckpt.codecs.pickle_bounds import check_torch_file
from shardckpt.codecs.pickle_scan import (
    ATTRIBUTE_BAGS,
    TRUST_HINT,
    DamagedPickle,
    LoadFailure,
    judge_failed_load,
    quiet_protocol_warning,
)
from shardckpt.codecs.zip_skeleton import FileSlice
from shardckpt.core.errors import BadInputError, ShardckptError, UnsafePickleError
from shardckpt.core.files import os_error, os_error_in, source_stream
from shardckpt.core.signals import Interrupted
from shardckpt.core.torch_internals import dcp_storage_info
from shardckpt.core.words import shown
from shardckpt.formats.dcp import plain_metadata
from shardckpt.formats.dcp.values import REFUSED
from shardckpt.state.dtypes import as_torch


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, with values loaded ``weights_only`` and row targets as chunks.

    ``row_starts`` maps a key whose target holds only some rows to its first row: DCP
    gets that target as one chunk at that offset (``create_read_items_for_chunk_list``,
    the helper DCP itself uses for a DTensor's shard) and fills it from the stored
    chunks it overlaps.
    """

    def __init__(
        self,
        trust_pickle: bool,
        where: Path,
        row_starts: dict[str, int] | None = None,
        stored_value: Callable[[str, bytes, object], object] | None = None,
    ):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.trust_pickle = trust_pickle
        self.where = where
        self.values: dict[str, object] = {}
        self.row_starts = row_starts or {}
        self.stored_value = stored_value or (lambda _key, _stored, loaded: loaded)

    def create_local_plan(self) -> LoadPlan:
        whole = {k: v for k, v in self.state_dict.items() if k not in self.row_starts}
        items = list(create_default_local_load_plan(whole, self.metadata).items)
        for key, start in self.row_starts.items():
            target = self.state_dict[key]
            offsets = torch.Size((start,) + (0,) * (target.dim() - 1))
            chunk = ChunkStorageMetadata(offsets=offsets, sizes=target.size())
            md = self.metadata.state_dict_metadata[key]
            items += create_read_items_for_chunk_list(key, md, [chunk])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        # A row target is a plain tensor; its read items name it by its row offset.
        if index.fqn in self.row_starts:
            return self.state_dict[index.fqn]
        return super().lookup_tensor(index)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        file = self._file_of(read_item)
        try:
            check_torch_file(value, file)
            with quiet_protocol_warning(), torch.serialization.safe_globals(list(ATTRIBUTE_BAGS)):
                loaded = torch.load(value, weights_only=not self.trust_pickle)
            self.values[key] = self.stored_value(key, value.getvalue(), loaded)
            return
        except DamagedPickle as exc:
            failure = LoadFailure("damaged", str(exc))
        except pickle.UnpicklingError as exc:
            # Refused, or a damaged pickle: only the first may be told to trust the file.
            # Other failures are DcpReader's "cannot read checkpoint data".
            failure = judge_failed_load(exc, value, self.trust_pickle)
        if failure.kind == "refused":
            kept = self.stored_value(key, value.getvalue(), REFUSED)
            if kept is not REFUSED:
                self.values[key] = kept
                return
        if failure.kind == "refused":
            raise UnsafePickleError(
                f"refused to unpickle value {shown(key)} ({failure.reason})",
                path=file,
                hint=TRUST_HINT,
            )
        raise BadInputError(
            f"value {shown(key)} is damaged ({failure.reason})",
            path=file,
            hint="re-copy the checkpoint from where it was written",
        )

    def _file_of(self, read_item) -> Path:
        """Return the ``.distcp`` file that holds ``read_item`` (the directory if unknown)."""
        info = (self.metadata.storage_data or {}).get(read_item.storage_index)
        return self.where / info.relative_path if info is not None else self.where


class _SourceFiles(FileSystem):
    """DCP's local filesystem, its files read through ``core.files`` (a URL SRC's objects from the store)."""

    @contextmanager
    def create_stream(self, path, mode: str):
        if mode != "rb":
            raise ValueError(f"SRC is only read, not opened with {mode!r}")
        with source_stream(path) as stream:
            yield stream


class _Storage(FileSystemReader):
    """DCP's file reader, given the metadata we already read (and checked) safely.

    A failure while reading a data file names that file and, once its bytes are being
    read, the key stored there: DCP's own errors ("EOFError", "mismatch sizes") name
    neither, and a denied permission is not a truncated file.
    """

    def __init__(self, path: Path, metadata: Metadata):
        super().__init__(path)
        self.fs = _SourceFiles()
        self._metadata = metadata
        self._reading: object = None  # the storage entry whose bytes are being read

    def read_metadata(self, *args, **kwargs) -> Metadata:
        return self._metadata

    def _slice_file(self, file, sinfo):
        self._reading = sinfo
        if not sinfo.transform_descriptors:
            # DCP torch.loads each stored entry (a torch.save zip) whole: its pickle passes
            # the same check first. A transformed entry's zip exists only once DCP's
            # extension has undone the transform (values are checked in load_bytes).
            entry = FileSlice(file.fileno(), sinfo.offset, sinfo.offset + sinfo.length)
            check_torch_file(io.BufferedReader(entry), Path(self.path) / sinfo.relative_path)
        return super()._slice_file(file, sinfo)

    def _key_being_read(self) -> str | None:
        """Return the key whose storage entry is being read (looked up only on failure)."""
        stored = (self._metadata.storage_data or {}).items()
        return next((index.fqn for index, info in stored if info is self._reading), None)

    def read_data(self, plan: LoadPlan, planner) -> Future:
        per_file: dict[str, list] = {}
        for item in plan.items:
            name = self.storage_data[item.storage_index].relative_path
            per_file.setdefault(name, []).append(item)
        for name, items in per_file.items():
            self._reading = None
            try:
                super().read_data(LoadPlan(items), planner).wait()
            except ShardckptError:
                raise
            except Exception as exc:
                raise _read_error(exc, Path(self.path) / name, self._key_being_read()) from None
        done: Future = Future()
        done.set_result(None)
        return done


def _read_error(exc: Exception, path: Path, key: str | None) -> ShardckptError:
    """Return the one-line error for ``exc``, raised while reading data file ``path``."""
    cause = os_error_in(exc)
    if cause is not None:
        error = os_error(cause, path)
        if key is None:
            return error
        return type(error)(f"{error.message} at {key!r}", path=path, hint=error.hint)
    what = f"the data of {key!r}" if key is not None else "its data"
    return BadInputError(
        f"cannot read {what} ({type(exc).__name__}: {_reason(exc)})",
        path=path,
        hint="the file is damaged or does not match .metadata; re-copy it from where the checkpoint was written",
    )


def _reason(exc: Exception) -> str:
    """Return the line of ``exc``'s message that says what was wrong with the bytes."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    # weights_only's refusal opens with advice to load with weights_only=False, which
    # is no fix for damaged bytes; its reason is the line after this marker.
    marker = "WeightsUnpickler error:"
    for here, line in enumerate(lines[:-1]):
        if line.endswith(marker):
            return lines[here + 1]
    return lines[0] if lines else ""


def load(src: Path, metadata, state_dict: dict, planner: SafeLoadPlanner) -> None:
    """Load ``state_dict``'s keys from the DCP checkpoint at ``src`` with DCP's loader and ``planner``."""
    try:
        # no_dist: every rank plans and reads on its own; no collective can hang here.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(
                state_dict,
                storage_reader=_Storage(src, torch_metadata(metadata)),
                planner=planner,
                no_dist=True,
            )
    except (Exception, CheckpointException) as exc:
        cause = _first_cause(exc)
        # DCP wraps every BaseException, a signal's too: that one still ends the run.
        if isinstance(cause, (ShardckptError, Interrupted)):
            raise cause from None
        text = str(cause).strip().splitlines()
        raise BadInputError(
            f"cannot read checkpoint data ({type(cause).__name__}: {text[0] if text else ''})",
            path=src,
            hint="the checkpoint is truncated or inconsistent; re-copy it from where it was written",
        ) from None


def _first_cause(exc: BaseException) -> BaseException:
    """Return the error behind DCP's CheckpointException (a BaseException that wraps each rank's)."""
    failures = getattr(exc, "failures", None)
    if not failures:
        return exc
    cause = next(iter(failures.values()))
    return cause[0] if isinstance(cause, tuple) else cause


def torch_metadata(md):
    """Return ``md`` as torch's metadata classes, which DCP's loader checks by type.

    ``.metadata`` read without torch holds ``plain_metadata``'s stand-ins; a value or
    chunk that only DCP's loader reads then comes here. What the loader asks of a
    tensor's properties is its dtype: layout and memory format keep torch's defaults.
    """
    if not isinstance(md, plain_metadata.Metadata):
        return md
    storage_info = dcp_storage_info()
    entries: dict[str, object] = {}
    for key, entry in md.state_dict_metadata.items():
        if isinstance(entry, plain_metadata.BytesStorageMetadata):
            entries[key] = BytesStorageMetadata()
            continue
        props = entry.properties
        entries[key] = TensorStorageMetadata(
            TensorProperties(
                dtype=as_torch(props.dtype),
                requires_grad=props.requires_grad,
                pin_memory=props.pin_memory,
            ),
            torch.Size(entry.size),
            [
                ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes))
                for c in entry.chunks
            ],
        )
    storage = {
        MetadataIndex(index.fqn, index.offset, index.index): storage_info(
            info.relative_path, info.offset, info.length, info.transform_descriptors
        )
        for index, info in (md.storage_data or {}).items()
    }
    return Metadata(
        entries,
        planner_data=md.planner_data,
        storage_data=storage,
        storage_meta=md.storage_meta and StorageMeta(**vars(md.storage_meta)),
        version=md.version,
    )
