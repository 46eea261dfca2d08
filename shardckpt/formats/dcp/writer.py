"""Writing ``dcp`` for M target ranks from any number of processes, with DCP's own protocol.

``dcp.save`` writes one file per process of the launch. To write M files from N
processes, each process runs DCP's per-rank steps once per target rank it acts for
(``shardckpt.formats.ranks.target_ranks``), and the object collectives DCP would run among M ranks run
among the N real ones instead. Call order, as in torch's ``_save_state_dict``:
  1) (each target rank) ``planner.set_up_planner`` -> ``create_local_plan`` ->
     ``storage_writer.prepare_local_plan``; the plans are gathered to real rank 0.
  2) (coordinator, target rank 0) ``planner.create_global_plan`` (dedup of tensors
     every rank holds, metadata, validation) -> ``storage_writer.prepare_global_plan``
     (file ``__r_0.distcp`` for target rank r); the plans are broadcast back.
  3) (each target rank) ``planner.finish_plan``; instead of ``write_data``, its data file
     is laid out as ``FileSystemWriter`` writes it (pickled values, then ``torch.save``
     of each tensor item) with placeholders for the tensor bytes, which the engine
     fills from the source afterwards (``shardckpt/engine/fill.py``); the write results,
     known from the layout, are gathered to real rank 0.
  4) (coordinator, after the engine filled every region) ``storage_writer.finish
     (metadata, results)`` writes ``.metadata``.
No process holds more than the engine's batch of tensor data at any time.
Every step runs under ``Runtime.agreed``, so a failure anywhere stops every process; a
failed write (a full disk) is one line naming the file, exit 4.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, FileSystem
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from shardckpt.codecs.zip_skeleton import pwrite_all, tensor_blob, write_blob
from shardckpt.core.dist import Runtime
from shardckpt.core.errors import BadInputError
from shardckpt.core.files import os_error, writing
from shardckpt.core.torch_internals import dcp_storage_info, dcp_v2_3_paths
from shardckpt.formats.base import Frame, Writer
from shardckpt.formats.ranks.rank_file import Fills, dtensor_placeholders
from shardckpt.formats.ranks.target_ranks import create, merge_frames, virtual_mesh
from shardckpt.formats.torch_save.file import storage_of
from shardckpt.state.regions import Region
from shardckpt.state.tree import walk

_METADATA_TMP = ".metadata.tmp"  # what FileSystemWriter.finish writes, then renames


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


def _in_target_order(per_rank: list[dict[int, object]], world_size: int) -> list:
    """Return the values of the per-process ``{target rank: value}`` dicts ordered by target rank."""
    merged = {r: v for part in per_rank for r, v in part.items()}
    return [merged[r] for r in range(world_size)]


class DcpWriter(Writer):
    """``dcp`` at M target ranks: DCP's planning, then each target rank's data file laid out and filled.

    The state dicts DCP plans hold placeholders, so no tensor data exists until the
    engine fills the regions. ``.metadata`` is written by DCP's own ``finish`` from the
    write results, which are known from the layout alone.
    """

    # DCP's loader reads .metadata on every rank.
    every_copy = (".metadata",)

    def __init__(self, root: Path, plan):
        super().__init__(root, plan)
        self._storage = _Writer(root)
        described = repr((plan.world_size, [(p, m.shape, str(m.dtype)) for p, m in plan.tensors]))
        self._storage.save_id = str(uuid.uuid5(uuid.NAMESPACE_OID, described))
        self._finish: tuple | None = None

    def frame(self, runtime: Runtime) -> Frame:
        plan = self.plan
        targets = self.targets(runtime)
        planners = {r: _SavePlanner(self.stored_bytes) for r in targets}
        fills: dict[int, Fills] = {r: {} for r in targets}

        def local_plans() -> dict[int, SavePlan]:
            self._storage.set_up_storage_writer(
                runtime.coordinator, rank=runtime.rank, use_collectives=True
            )
            plans = {}
            for r in targets:
                planner = planners[r]
                planner.set_up_planner(
                    dtensor_placeholders(plan, r, virtual_mesh(plan.world_size, r), fills[r]),
                    storage_meta=self._storage.storage_meta(),
                    is_coordinator=r == 0,
                )
                plans[r] = self._storage.prepare_local_plan(planner.create_local_plan())
            return plans

        gathered = runtime.gather(runtime.agreed(local_plans))

        def global_plan():
            if not runtime.coordinator:
                return None
            plans, metadata = planners[0].create_global_plan(
                _in_target_order(gathered, plan.world_size)
            )
            return self._storage.prepare_global_plan(plans), metadata

        central = runtime.agreed(global_plan)
        final = runtime.broadcast(central[0] if central is not None else None)

        def lay_out() -> tuple[Frame, dict[int, list[WriteResult]]]:
            frames, results = [], {}
            for r in targets:
                frame, results[r] = _lay_out_file(
                    self.root, planners[r], planners[r].finish_plan(final[r]), fills[r]
                )
                frames.append(frame)
            return merge_frames(frames), results

        frame, results = runtime.agreed(lay_out)
        everyone = runtime.gather(results)
        if runtime.coordinator:
            self._finish = (central[1], _in_target_order(everyone, plan.world_size))
        return frame

    def stored_bytes(self, key: str, value: object) -> bytes | None:
        """Return the bytes value ``key`` is stored as, where they are not DCP's ``torch.save`` of ``value``.

        None here: a format that carries values as they were stored (Megatron's
        ShardedObjects) returns their bytes.
        """
        return None

    def finish(self) -> None:
        metadata, results = self._finish
        # Results reach the coordinator pickled from other processes; its own are pickled
        # the same way, so that .metadata's bytes (pickle shares repeated objects) do not
        # depend on how many processes wrote.
        self._storage.finish(*_one_object_per_name(metadata, results))


def _one_object_per_name(metadata, results: list) -> tuple:
    """Return ``metadata`` and ``results`` with each key and path name one ``str`` object throughout.

    A path of one key (a tree whose leaves sit at the top: Megatron's, Hugging Face's)
    is DCP's flat key itself, the same object, in what this process planned and wrote,
    and an equal copy in what other processes sent; pickle writes a shared object once,
    so without this ``.metadata``'s bytes would depend on how many processes wrote.
    """
    name = sys.intern
    metadata.state_dict_metadata = {name(k): v for k, v in metadata.state_dict_metadata.items()}
    if metadata.planner_data:
        metadata.planner_data = {
            name(k): tuple(name(p) if type(p) is str else p for p in path)
            for k, path in metadata.planner_data.items()
        }
    results = [
        [
            dataclasses.replace(r, index=dataclasses.replace(r.index, fqn=name(r.index.fqn)))
            for r in rs
        ]
        for rs in pickle.loads(pickle.dumps(results))
    ]
    return metadata, results


def _lay_out_file(
    root: Path, planner: _SavePlanner, plan: SavePlan, fills: Fills
) -> tuple[Frame, list[WriteResult]]:
    """Write one target rank's data file without tensor bytes; return its regions and write results.

    As DCP's ``FileSystemWriter`` lays it out (``__{r}_0.distcp``): the pickled plain
    values, then each tensor item as ``torch.save`` of that tensor alone.
    """
    name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
    storage_info = dcp_storage_info()
    frame, results = Frame(), []
    fd = create(root / name)
    try:
        offset = 0
        values = [i for i in plan.items if i.type == WriteItemType.BYTE_IO]
        tensors = [i for i in plan.items if i.type != WriteItemType.BYTE_IO]
        for item in values:
            data = planner.resolve_data(item).getbuffer()
            with writing(root / name):
                pwrite_all(fd, data, offset)
            results.append(
                WriteResult(item.index, len(data), storage_info(name, offset, len(data)))
            )
            offset += len(data)
        for item in tensors:
            placeholder = planner.lookup_object(item.index)
            chunk = item.tensor_data.chunk
            blob = tensor_blob(tuple(chunk.sizes), placeholder.dtype)
            with writing(root / name):
                record = write_blob(fd, offset, blob, name)
            for key, start, stop, _ in fills[storage_of(placeholder)]:
                frame.regions.append(Region(key, start, stop, name, record.start, record))
            frame.records.append(record)
            results.append(
                WriteResult(item.index, blob.size, storage_info(name, offset, blob.size))
            )
            offset += blob.size
    finally:
        os.close(fd)
    return frame, results
