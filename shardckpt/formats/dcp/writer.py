"""Writing ``dcp`` for M target ranks from any number of processes, as ``dcp.save`` at M would.

``dcp.save`` writes one data file per rank. To write M files from N processes without
M ranks, the save is planned once for the tree (``save_plan``: DCP's per-rank planning,
dedup and global plan, as they come out for FSDP2's state dicts at M; no placeholder
DTensor per target rank, nothing gathered), then:
  1) (every process) ``frame``: the plan, derived from the tree alone; a file job per
     target rank it acts for (``__r_0.distcp``, as ``FileSystemWriter`` lays it out:
     the pickled values, then ``torch.save`` of each tensor item), which the engine
     writes front to back with the source's bytes (``shardckpt/engine/jobs.py``);
  2) (coordinator, once every file is written) ``finish``: ``.metadata``, the bytes
     ``FileSystemWriter.finish`` writes, streamed (``metadata_file``).
No process holds more than the engine's batch of tensor data, nor a target rank's plan
as objects. Every step runs under ``Runtime.agreed``, so a failure anywhere stops every
process; a failed write (a full disk) is one line naming the file, exit 4.
"""

from __future__ import annotations

import io
import os
import pickle
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from shardckpt.codecs.pickle_stream import NotStreamable, dump, materialized
from shardckpt.core.background import Background
from shardckpt.core.dist import Runtime
from shardckpt.core.errors import BadInputError
from shardckpt.core.files import os_error, writing
from shardckpt.core.torch_internals import dcp_v2_3_paths, dcp_version
from shardckpt.formats.base import Frame, Writer
from shardckpt.formats.dcp.metadata_file import FileLayout, data_file, metadata, storage_count
from shardckpt.formats.dcp.save_plan import (
    SHARD,
    VALUE,
    WHOLE,
    DcpSavePlan,
    Entry,
    Split,
    storage_cost,
)
from shardckpt.state.regions import Blob, FileJob, Record, Region, row_elements
from shardckpt.state.tree import TensorMeta, map_leaves, walk

METADATA_FILE = ".metadata"
_METADATA_TMP = ".metadata.tmp"  # what FileSystemWriter.finish writes, then renames
# From this many storage items (chunks and values; about 12 µs each to stream on the
# 2-core box, so about a second) ``.metadata`` is written by a forked process beside the
# data files; below, by the coordinator in ``finish``, where a fork costs more than it saves.
BACKGROUND_ITEMS = 100_000


class _SavePlanner(DefaultSavePlanner):
    """DCP's save planner, keeping the empty mappings DCP's flattening drops.

    DCP stores leaves only, and an empty mapping has none: ``{"a": {}}`` loses ``a``,
    and an optimizer's ``state`` before its first step goes, leaving a dict that is no
    longer an optimizer state dict. Each empty mapping is kept under its dotted key
    (DCP's name for its path), with its path in ``planner_data``, in one of two ways:

    - as a plain value ``{}``, stored like any other: torch's readers see it too
      (``dcp_to_torch_save`` rebuilds it at its path; ``dcp.load`` fills it in);
    - as its path alone (``planner_data`` with no ``state_dict_metadata`` entry; only
      shardckpt reads it) where DCP's 2.3 traversal stops at it: that is where a
      loader whose state dict also holds this ``{}`` would take the stored key as a
      sign of a pre-2.4 checkpoint, switch to 2.3 keys and fail ("Missing key in
      checkpoint state_dict: optim.param_groups"). Any top-level ``{}`` is such a
      place, and so is a ``{}`` beside tensors in a list; the ``state`` of an optimizer
      that holds no tensor (SGD without momentum) is not.

    Empty lists need none of this: DCP stores ``[]`` as a value.

    ``stored_bytes`` (``DcpWriter.stored_bytes``) gives a value's stored bytes where they
    are not ``torch.save`` of it.
    """

    def __init__(self, stored_bytes: Callable[[str, object], bytes | None] | None = None):
        super().__init__()
        self.stored_bytes = stored_bytes

    def transform_object(self, write_item, object):
        key = write_item.index.fqn
        stored = self.stored_bytes(key, object) if self.stored_bytes is not None else None
        if stored is not None:
            return io.BytesIO(stored)
        return super().transform_object(write_item, object)

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        try:
            super().set_up_planner(state_dict, storage_meta, is_coordinator)
        except ValueError as exc:  # flatten_state_dict: "duplicated flatten key ..."
            raise _cannot_flatten(str(exc)) from None
        legacy: set[str] | None = None  # traversed at the first {}: only a {} needs it
        # Rebuilt in tree order, so that each {} keeps its place among its siblings.
        flat, mappings = {}, {}
        for path, leaf in _dcp_leaves(state_dict):
            key = _flat_key(path)
            if isinstance(leaf, Mapping) and not leaf:
                if key in self.mappings or key in mappings:
                    raise _cannot_flatten(f"duplicated flatten key {key}")
                mappings[key] = path
                if legacy is None:
                    legacy = {_flat_key(p) for p in dcp_v2_3_paths(state_dict)}
                if key not in legacy:
                    flat[key] = {}
            elif key in self.state_dict:
                flat[key], mappings[key] = self.state_dict[key], self.mappings[key]
        for key, value in self.state_dict.items():
            if key not in flat:
                flat[key], mappings[key] = value, self.mappings[key]
        self.state_dict, self.mappings = flat, mappings


def _flat_key(path: tuple) -> str:
    """Return DCP's flat key for ``path`` (``flatten_state_dict`` joins it with dots)."""
    return ".".join(map(str, path))


def _dcp_leaves(state_dict: dict) -> Iterator[tuple[tuple, object]]:
    """Yield ``(path, leaf)`` in tree order, with paths as DCP writes them (mapping keys as str)."""
    for path, leaf in walk(state_dict):
        node: object = state_dict
        dcp_path = []
        for part in path:
            dcp_path.append(str(part) if isinstance(node, Mapping) else part)
            node = node[part]  # type: ignore[index]
        yield tuple(dcp_path), leaf


def _cannot_flatten(reason: str) -> BadInputError:
    return BadInputError(
        f"cannot be written as DCP ({reason}): two paths have one dotted name",
        hint="--rename or --drop one of them, or write --to full",
    )


class _NamedFiles(FileSystem):
    """DCP's file access, with each failure turned into one line naming the file."""

    @contextmanager
    def create_stream(self, path, mode):
        path = Path(path)
        # .metadata is written as .metadata.tmp and renamed: name the file the user knows.
        shown = path.with_name(".metadata") if path.name == _METADATA_TMP else path
        with writing(path, shown), super().create_stream(path, mode) as stream:
            yield stream

    def mkdir(self, path) -> None:
        try:
            super().mkdir(path)
        except OSError as exc:
            raise os_error(exc, path, writing=True) from None

    def rename(self, path, new_path) -> None:
        try:
            super().rename(path, new_path)
        except OSError as exc:
            raise os_error(exc, new_path, writing=True) from None

    def rm_file(self, path) -> None:
        try:
            super().rm_file(path)
        except OSError as exc:
            raise os_error(exc, path, writing=True) from None


class _Writer(FileSystemWriter):
    """DCP's file writer: one file per rank (``thread_count=1``), errors naming the file."""

    def __init__(self, path: str | os.PathLike):
        # What dcp.save does by default, so each target rank gets exactly one data
        # file, as it would in training.
        super().__init__(path, single_file_per_rank=True, thread_count=1)
        self.fs = _NamedFiles()
        self.save_id: str | None = None

    def storage_meta(self) -> StorageMeta:
        """Return what ``.metadata`` records of this save: no path, a save id from the plan.

        DCP records the path written to (ours is the staging path, renamed afterwards) and
        a random id; both are informational. The id is derived from what is written, so
        the same conversion gives the same bytes at any launch size.
        """
        return StorageMeta(checkpoint_id=None, save_id=self.save_id)


class DcpWriter(Writer):
    """``dcp`` at M target ranks: DCP's save planning done once for the tree, each target rank's data file laid out and filled.

    The plan is DCP's own for FSDP2's state dicts at M (``save_plan``): every process
    derives it from the tree alone, so nothing is gathered; each process writes the data
    files of the target ranks it acts for as file jobs (front to back, no placeholder
    written first), and the coordinator writes ``.metadata`` as ``finish`` would
    (``metadata_file``), streamed.
    """

    # DCP's loader reads .metadata on every rank.
    every_copy = (".metadata",)

    def __init__(self, root: Path, plan):
        super().__init__(root, plan)
        self._storage = _Writer(root)
        described = repr((plan.world_size, [(p, m.shape, str(m.dtype)) for p, m in plan.tensors]))
        self._storage.save_id = str(uuid.uuid5(uuid.NAMESPACE_OID, described))
        self._layout: FileLayout | None = None
        self._mappings: dict = {}
        self._metadata: Background | None = None

    def frame(self, runtime: Runtime) -> Frame:
        runtime.agreed(self._plan)
        targets = self.targets(runtime)

        def lay_out() -> Frame:
            with writing(self.root):
                self.root.mkdir(parents=True, exist_ok=True)
            if runtime.coordinator and self._worth_a_process():
                # .metadata needs the plan alone: a second core writes it while the data goes.
                self._metadata = Background(self._write_metadata)
            return Frame(files=[self._job(r) for r in targets])

        return runtime.agreed(lay_out)

    def _worth_a_process(self) -> bool:
        """Return whether ``.metadata`` is large enough to write in a process of its own."""
        assert self._layout is not None
        return storage_count(self._layout.save) >= BACKGROUND_ITEMS

    def _plan(self) -> None:
        """Plan the save as DCP would at M (the same on every process): entries, dedup, value bytes."""
        planner = _SavePlanner(self.stored_bytes)
        tree, leaf_of = _placeholders(self.plan.tree)
        planner.set_up_planner(tree, storage_meta=self._storage.storage_meta(), is_coordinator=True)
        entries = []
        splits: dict[int, Split] = {}
        for fqn, obj in planner.state_dict.items():
            meta = leaf_of.get(id(obj))
            fqn = sys.intern(fqn)
            if meta is None:
                entries.append(Entry(fqn, VALUE, value=obj))
            elif meta.key in self.plan.whole:
                entries.append(Entry(fqn, WHOLE, meta, cost=storage_cost(meta)))
            else:
                rows = meta.shape[0]
                split = splits.setdefault(rows, Split(rows, self.plan.world_size))
                entries.append(Entry(fqn, SHARD, meta, split=split, cost=storage_cost(meta)))
        values: dict[int, bytes] = {}

        def value_bytes(index: int) -> bytes:
            if index not in values:
                item = WriteItem(
                    index=MetadataIndex(entries[index].fqn), type=WriteItemType.BYTE_IO
                )
                values[index] = bytes(planner.resolve_data(item).getbuffer())
            return values[index]

        self._layout = FileLayout(DcpSavePlan(entries, self.plan.world_size), value_bytes)
        self._mappings = planner.mappings

    def _job(self, rank: int) -> FileJob:
        """Return target rank ``rank``'s data file as a file job: values, then ``torch.save`` blobs of its chunks."""
        layout = self._layout
        assert layout is not None
        name = data_file(rank)
        entries = layout.save.entries

        def segments() -> tuple[list, list[Record]]:
            out: list = []
            for index, offset, first, count, blob in layout.items(rank):
                if blob is None:
                    out.append(layout.value_bytes(index))
                    continue
                meta = entries[index].meta
                assert meta is not None
                row = row_elements(meta) if meta.shape else 1
                start = blob.data.start + offset
                region = Region(meta.key, first * row, (first + count) * row, name, start)
                out.append(Blob(blob.head, region, blob.tail, blob.data.crc_at))
            return out, []

        return FileJob(name, layout.data_bytes(rank), segments)

    def stored_bytes(self, key: str, value: object) -> bytes | None:
        """Return the bytes value ``key`` is stored as, where they are not DCP's ``torch.save`` of ``value``.

        None here: a format that carries values as they were stored (Megatron's
        ShardedObjects) returns their bytes.
        """
        return None

    def finish(self) -> None:
        """Put ``.metadata`` in place (coordinator), once its writer (``frame``'s background) ended."""
        if self._metadata is None:
            self._write_metadata()
        else:
            self._metadata.wait()
        fs = self._storage.fs
        final = self.root / METADATA_FILE
        if fs.exists(final):
            fs.rm_file(final)
        fs.rename(self.root / _METADATA_TMP, final)

    def _write_metadata(self) -> None:
        """Write ``.metadata``'s bytes as ``FileSystemWriter.finish`` does, streamed, to its temporary name."""
        assert self._layout is not None
        described = metadata(
            self._layout, self._mappings, self._storage.storage_meta(), dcp_version()
        )
        tmp = self.root / _METADATA_TMP
        fs = self._storage.fs
        with fs.create_stream(tmp, "wb") as stream:
            try:
                dump(described, stream, protocol=pickle.DEFAULT_PROTOCOL)
            except NotStreamable:
                stream.seek(0)
                stream.truncate()
                pickle.dump(materialized(described), stream)
            stream.flush()
            os.fsync(stream.fileno())


def _placeholders(tree: dict) -> tuple[dict, dict[int, TensorMeta]]:
    """Return ``tree`` with each tensor a tiny placeholder DCP's flattening treats as a tensor, and each's meta."""
    leaf_of: dict[int, TensorMeta] = {}

    def place(_path, leaf):
        if not isinstance(leaf, TensorMeta):
            return leaf
        placeholder = torch.empty(0)
        leaf_of[id(placeholder)] = leaf
        return placeholder

    return map_leaves(tree, place), leaf_of
