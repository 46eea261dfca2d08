"""Writing ``dcp`` for M target ranks from any number of processes, with DCP's own protocol.

``dcp.save`` writes one file per process of the launch. To write M files from N
processes, each process runs DCP's per-rank steps once per target rank it acts for
(``shardckpt.virtual``), and the object collectives DCP would run among M ranks run
among the N real ones instead. Call order, as in torch's ``_save_state_dict``:
  1) (each target rank) ``planner.set_up_planner`` -> ``create_local_plan`` ->
     ``storage_writer.prepare_local_plan``; the plans are gathered to real rank 0.
  2) (coordinator, target rank 0) ``planner.create_global_plan`` (dedup of tensors
     every rank holds, metadata, validation) -> ``storage_writer.prepare_global_plan``
     (file ``__r_0.distcp`` for target rank r); the plans are broadcast back.
  3) (each target rank) ``planner.finish_plan`` -> ``storage_writer.write_data``;
     the write results are gathered to real rank 0.
  4) (coordinator) ``storage_writer.finish(metadata, results)`` writes ``.metadata``.
Every step runs under ``Runtime.agreed``, so a failure anywhere stops every process; a
failed write (a full disk) is one line naming the file, exit 4.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._traverse import traverse_state_dict_v_2_3
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import SavePlan

from shardckpt.dist import Runtime
from shardckpt.errors import BadInputError
from shardckpt.formats.files import os_error, writing
from shardckpt.tree import walk

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
    """

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        try:
            super().set_up_planner(state_dict, storage_meta, is_coordinator)
        except ValueError as exc:  # flatten_state_dict: "duplicated flatten key ..."
            raise _cannot_flatten(str(exc)) from None
        legacy: set[str] = set()
        traverse_state_dict_v_2_3(state_dict, lambda path, _: legacy.add(_flat_key(path)))
        # Rebuilt in tree order, so that each {} keeps its place among its siblings.
        flat, mappings = {}, {}
        for path, leaf in _dcp_leaves(state_dict):
            key = _flat_key(path)
            if isinstance(leaf, Mapping) and not leaf:
                if key in self.mappings or key in mappings:
                    raise _cannot_flatten(f"duplicated flatten key {key}")
                mappings[key] = path
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


def _in_target_order(per_rank: list[dict[int, object]], world_size: int) -> list:
    """Return the values of the per-process ``{target rank: value}`` dicts ordered by target rank."""
    merged = {r: v for part in per_rank for r, v in part.items()}
    return [merged[r] for r in range(world_size)]


def write_dcp(path: Path, state_dicts: dict[int, dict], world_size: int, runtime: Runtime) -> None:
    """Save ``state_dicts`` (target rank -> its state dict) as a DCP checkpoint of ``world_size`` ranks."""
    writer = _Writer(path)
    planners = {r: _SavePlanner() for r in state_dicts}

    def local_plans() -> dict[int, SavePlan]:
        writer.set_up_storage_writer(runtime.coordinator, rank=runtime.rank, use_collectives=True)
        plans = {}
        for r, state_dict in state_dicts.items():
            planner = planners[r]
            planner.set_up_planner(
                state_dict, storage_meta=writer.storage_meta(), is_coordinator=r == 0
            )
            plans[r] = writer.prepare_local_plan(planner.create_local_plan())
        return plans

    gathered = runtime.gather(runtime.agreed(local_plans))

    def global_plan():
        if not runtime.coordinator:
            return None
        plans, metadata = planners[0].create_global_plan(_in_target_order(gathered, world_size))
        return writer.prepare_global_plan(plans), metadata

    central = runtime.agreed(global_plan)
    plans = runtime.broadcast(central[0] if central is not None else None)

    def write() -> dict[int, list]:
        results = {}
        for r, planner in planners.items():
            future = writer.write_data(planner.finish_plan(plans[r]), planner)
            future.wait()
            results[r] = future.value()
        return results

    results = runtime.gather(runtime.agreed(write))
    runtime.agreed(
        lambda: (
            writer.finish(central[1], _in_target_order(results, world_size))
            if runtime.coordinator
            else None
        )
    )
