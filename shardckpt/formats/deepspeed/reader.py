"""``deepspeed``: a ZeRO-1/2/3 save (the run directory with ``latest``, or a ``global_stepN/``) as one tree.

Every rank's optimizer file is opened (memory-mapped; its pickle read with stand-ins,
``unpickle``), the layout of its flat partitions computed (``partitions``) and checked
against what DeepSpeed recorded (``param_slice_mappings``), and each parameter's fp32
master weights and Adam moments become ``Spans`` of those partitions: a read copies
just the rows asked for from the ranks' files that hold them. ``deepspeed-module``
reads the same save with ``model`` the module's own weights and buffers as saved.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from shardckpt.errors import BadInputError
from shardckpt.formats.base import Index, Reader, Rows
from shardckpt.formats.deepspeed import names
from shardckpt.formats.deepspeed.assemble import (
    MASTER,
    MODULE,
    Sources,
    Stored,
    Trainable,
    job_values,
    model_tree,
    module_tree,
    optim_tree,
)
from shardckpt.formats.deepspeed.lone_file import refuse_lone_file
from shardckpt.formats.deepspeed.partitions import (
    LayoutError,
    Placed,
    check_fragments,
    zero3,
    zero12,
)
from shardckpt.formats.deepspeed.sources import Whole, spans_of
from shardckpt.formats.deepspeed.states import (
    ModelStates,
    OptimStates,
    read_model_states,
    read_optim_states,
)
from shardckpt.formats.files import source_stat
from shardckpt.tree import TensorMeta

_RECOPY = "the files are not of one save; re-copy the checkpoint"


class ZeroSave:
    """Every file of one ZeRO save, read and checked against each other."""

    def __init__(self, src: Path):
        if not src.is_dir():
            refuse_lone_file(src)
            raise BadInputError(
                "is a file, not a DeepSpeed checkpoint directory",
                path=src,
                hint="pass the run directory (with 'latest') or a global_stepN directory",
            )
        self.files = names.tag_files(names.tag_dir(src))
        if 0 not in self.files.optim:
            raise BadInputError(
                "holds no optimizer file of rank 0 (zero_pp_rank_0_mp_rank_00_optim_states.pt)",
                path=self.files.dir,
                hint="copy every rank's files of the save; a save without ZeRO optimizer "
                "files is read as a torch file (--from torch)",
            )
        first = read_optim_states(self.files.optim[0])
        self.world_size = first.world_size
        names.check_ranks(self.files, self.world_size)
        self.optims = [first] + [
            read_optim_states(self.files.optim[r]) for r in range(1, self.world_size)
        ]
        self.stage = first.stage
        for o in self.optims[1:]:
            if (o.stage, o.world_size, len(o.flat)) != (
                first.stage,
                first.world_size,
                len(first.flat),
            ):
                raise BadInputError(
                    f"is of ZeRO stage {o.stage}, {o.world_size} ranks and {len(o.flat)} flat "
                    f"groups, where rank 0's file is of {first.stage}, {first.world_size} and "
                    f"{len(first.flat)}",
                    path=o.path,
                    hint=_RECOPY,
                )
        if (self.stage == 3) != self.files.per_rank_model:
            raise BadInputError(
                f"holds ZeRO stage {self.stage} optimizer files beside the model-states files "
                f"of stage {'3' if self.files.per_rank_model else '1/2'}",
                path=self.files.dir,
                hint=_RECOPY,
            )
        self.models = [read_model_states(self.files.model[r]) for r in sorted(self.files.model)]
        for m in self.models[1:]:
            if m.param_shapes != self.models[0].param_shapes:
                raise BadInputError(
                    "lists other parameters (param_shapes) than rank 0's model-states file",
                    path=m.path,
                    hint=_RECOPY,
                )
        if len(self.models[0].param_shapes) != len(first.flat):
            raise BadInputError(
                f"lists {len(self.models[0].param_shapes)} flat groups of parameters, but the "
                f"optimizer files hold {len(first.flat)}",
                path=self.models[0].path,
                hint=_RECOPY,
            )

    @property
    def layout(self) -> str:
        """Return how ``inspect`` describes a tensor kept in the flat partitions."""
        return f"ZeRO-{self.stage} flat over {self.world_size}"


def _partition(save: ZeroSave, g: int) -> tuple[list[int], int]:
    """Return how many elements each rank's file holds of group ``g``, and the partition size."""
    stored = [len(o.flat[g]) for o in save.optims]
    sizes = {n + (o.paddings[g] if o.lean else 0) for n, o in zip(stored, save.optims)}
    if len(sizes) != 1:
        raise BadInputError(
            f"the ranks' partitions of group {g} are of different sizes ({sorted(sizes)} "
            "elements with their padding)",
            path=save.files.dir,
            hint=_RECOPY,
        )
    return stored, sizes.pop()


def _place(save: ZeroSave) -> tuple[list[Placed], dict[int, int]]:
    """Return every trainable parameter in the partitions, and each flat tensor's param group."""
    first, shapes = save.optims[0], save.models[0].param_shapes
    placed: list[Placed] = []
    try:
        if save.stage == 3:
            for s, group in enumerate(shapes):
                placed += zero3(s, group, [len(o.flat[s]) for o in save.optims])
            return placed, _sub_groups(save)
        for g, group in enumerate(shapes):
            stored, size = _partition(save, g)
            paddings = first.alignment[g] if first.alignment is not None else (0,) * len(group)
            here = zero12(g, group, paddings, stored, size, first.lean)
            if first.fragments is not None and not _round_robin(save):
                check_fragments(here, [o.fragments[g] for o in save.optims])  # type: ignore[index]
            placed += here
    except LayoutError as exc:
        raise BadInputError(str(exc), path=save.files.dir, hint=_RECOPY) from None
    if len(first.param_groups) != len(shapes):
        raise BadInputError(
            f"has {len(first.param_groups)} param groups for {len(shapes)} flat groups",
            path=first.path,
            hint=_RECOPY,
        )
    return placed, {g: g for g in range(len(shapes))}


def _round_robin(save: ZeroSave) -> bool:
    """Return whether the job reordered each group's parameters round-robin (``round_robin_gradients``).

    Its flat groups (and ``param_shapes``) are then in that order, but DeepSpeed 0.19.8
    writes ``param_slice_mappings`` as if they were not: they cannot check the layout.
    """
    config = save.models[0].job.get("ds_config")
    zero = config.get("zero_optimization") if isinstance(config, dict) else None
    return isinstance(zero, dict) and bool(zero.get("round_robin_gradients"))


def _sub_groups(save: ZeroSave) -> dict[int, int]:
    """Return the param group of each ZeRO-3 sub-group (``param_groups[g]['params']`` lists them)."""
    first = save.optims[0]
    owner: dict[int, int] = {}
    for g, group in enumerate(first.param_groups):
        for s in group.get("params", []):
            if type(s) is not int or s in owner:
                raise BadInputError(
                    f"param group {g} lists {s!r}, not a sub-group of its own",
                    path=first.path,
                    hint=_RECOPY,
                )
            owner[s] = g
    if sorted(owner) != list(range(len(first.flat))):
        raise BadInputError(
            f"its param groups list sub-groups {sorted(owner)}, but it holds {len(first.flat)}",
            path=first.path,
            hint=_RECOPY,
        )
    return owner


def _state_of(o: OptimStates, flat: int) -> dict:
    state = o.state.get(flat, {})
    if not isinstance(state, dict):
        raise BadInputError(
            f"the optimizer state of flat tensor {flat} is not a dict", path=o.path, hint=_RECOPY
        )
    return state


def _group_states(save: ZeroSave, flat: int) -> tuple[list[str], dict]:
    """Return the per-element state names of one flat tensor, and its other state (step, ...) as read.

    A per-element state (``exp_avg``) is a 1-D tensor as long as the partition (with or
    without its end padding) on every rank; a 0-d tensor (``step``) or a plain value is
    the group's, the same on every rank.
    """
    first = _state_of(save.optims[0], flat)
    per_element, shared = [], {}
    for name, value in first.items():
        values = [_state_of(o, flat).get(name) for o in save.optims]
        if isinstance(value, torch.Tensor) and value.dim() == 1:
            for o, v in zip(save.optims, values):
                if not isinstance(v, torch.Tensor) or v.dim() != 1 or len(v) < len(o.flat[flat]):
                    raise BadInputError(
                        f"optimizer state '{name}' of flat tensor {flat} is not a 1-D tensor as "
                        "long as the rank's partition",
                        path=o.path,
                        hint=_RECOPY,
                    )
            per_element.append(name)
        elif isinstance(value, torch.Tensor) and value.dim() == 0:
            if not all(isinstance(v, torch.Tensor) and torch.equal(v, value) for v in values):
                raise BadInputError(
                    f"optimizer state '{name}' of flat tensor {flat} differs between the ranks",
                    path=save.files.dir,
                    hint=_RECOPY,
                )
            shared[name] = Stored(Whole(value.detach()), (), value.dtype, "full")
        elif isinstance(value, torch.Tensor):
            raise BadInputError(
                f"optimizer state '{name}' of flat tensor {flat} is a tensor of shape "
                f"{list(value.shape)}, neither per element nor one value",
                path=save.optims[0].path,
                hint="shardckpt reads optimizers whose state is per element or per parameter "
                "(Adam, AdamW, SGD, ...)",
            )
        else:
            shared[name] = value
    return per_element, shared


def _master_flat(save: ZeroSave):
    """Return ``(rank, flat) -> tensor``: each rank's fp32 partitions."""
    return lambda rank, flat: save.optims[rank].flat[flat]


def _state_flat(save: ZeroSave, name: str):
    """Return ``(rank, flat) -> tensor``: each rank's partitions of optimizer state ``name``."""
    return lambda rank, flat: _state_of(save.optims[rank], flat)[name]


def trainables(save: ZeroSave) -> list[Trainable]:
    """Return every trainable parameter: its fp32 master and state as spans of the ranks' files."""
    placed, group_of = _place(save)
    states = {flat: _group_states(save, flat) for flat in group_of}
    out = []
    for p in placed:
        per_element, shared = states[p.flat]
        master = spans_of(_master_flat(save), p.pieces)
        entry: dict = {}
        # In the order the optimizer saved them (step, exp_avg, exp_avg_sq for AdamW).
        for name, value in _state_of(save.optims[0], p.flat).items():
            if name in per_element:
                source = spans_of(_state_flat(save, name), p.pieces)
                entry[name] = Stored(source, p.shape, value.dtype, save.layout)
            else:
                entry[name] = shared[name]
        stored = Stored(master, p.shape, torch.float32, save.layout)
        out.append(Trainable(p.fqn, group_of[p.flat], stored, entry))
    return out


class DeepSpeedReader(Reader):
    """Reads a ZeRO save: ``model`` the fp32 master weights (``zero_to_fp32``'s), ``optim`` FQN-keyed."""

    format = "deepspeed"
    view = MASTER

    def __init__(self, src, trust_pickle: bool = False):
        super().__init__(src, trust_pickle)
        source_stat(self.src)
        self.save = ZeroSave(self.src)
        self.sources = Sources()
        self._notes: list[str] = []
        found = trainables(self.save)
        models = self.save.models
        if self.view == MODULE:
            model = self._module(models[0])
        else:
            model = model_tree(models, found, self.sources, self.save.stage == 3, self._notes)
        first = self.save.optims[0]
        self._tree = {
            "model": model,
            "optim": optim_tree(found, first.param_groups, self.sources),
            **job_values(models[0], first.scaler, self.sources),
        }

    def _module(self, model: ModelStates) -> dict:
        if self.save.stage == 3:
            raise BadInputError(
                "is a ZeRO-3 save: its model-states files hold every parameter as a "
                "placeholder, and no 16-bit module weights",
                path=self.save.files.dir,
                hint="read the fp32 master weights (--from deepspeed), with --dtype bf16 to "
                "cast them",
            )
        return module_tree(model, self.sources)

    def index(self) -> Index:
        return Index(self.format, str(self.src), self.save.world_size, self._tree)

    def notes(self) -> list[str]:
        return list(self._notes)

    def read(
        self, metas: Sequence[TensorMeta], rows: Sequence[Rows], runtime
    ) -> list[torch.Tensor]:
        return self.sources.read(metas, rows)


class DeepSpeedModuleReader(DeepSpeedReader):
    """Reads a ZeRO-1/2 save with ``model`` the module's own weights and buffers as saved."""

    format = "deepspeed-module"
    view = MODULE
