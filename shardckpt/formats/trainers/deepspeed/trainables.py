"""A ZeRO save's trainable parameters: where each one's fp32 master and optimizer state lie.

The layout of each param group's (ZeRO-3: sub-group's) flat partitions is computed from
``param_shapes`` and the partitions' sizes (``partitions``), checked against DeepSpeed's
``param_slice_mappings``, and every parameter's fp32 master and per-element optimizer
state (``exp_avg``, ...) become ``Spans`` of the ranks' memory-mapped partitions; the
per-group state (``step``) is one value, the same on every rank.
"""

from __future__ import annotations

import torch

from shardckpt.core.errors import BadInputError
from shardckpt.formats.torch_save import in_place
from shardckpt.formats.trainers.deepspeed.assemble import Stored, Trainable
from shardckpt.formats.trainers.deepspeed.partitions import (
    LayoutError,
    Placed,
    check_fragments,
    zero3,
    zero12,
)
from shardckpt.formats.trainers.deepspeed.save import RECOPY, ZeroSave
from shardckpt.formats.trainers.deepspeed.sources import Whole, spans_of
from shardckpt.formats.trainers.deepspeed.states import OptimStates


def _partition(save: ZeroSave, g: int) -> tuple[list[int], int]:
    """Return how many elements each rank's file holds of group ``g``, and the partition size."""
    stored = [len(o.flat[g]) for o in save.optims]
    sizes = {n + (o.paddings[g] if o.lean else 0) for n, o in zip(stored, save.optims)}
    if len(sizes) != 1:
        raise BadInputError(
            f"the ranks' partitions of group {g} are of different sizes ({sorted(sizes)} "
            "elements with their padding)",
            path=save.files.dir,
            hint=RECOPY,
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
        raise BadInputError(str(exc), path=save.files.dir, hint=RECOPY) from None
    if len(first.param_groups) != len(shapes):
        raise BadInputError(
            f"has {len(first.param_groups)} param groups for {len(shapes)} flat groups",
            path=first.path,
            hint=RECOPY,
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
                    hint=RECOPY,
                )
            owner[s] = g
    if sorted(owner) != list(range(len(first.flat))):
        raise BadInputError(
            f"its param groups list sub-groups {sorted(owner)}, but it holds {len(first.flat)}",
            path=first.path,
            hint=RECOPY,
        )
    return owner


def _state_of(o: OptimStates, flat: int) -> dict:
    state = o.state.get(flat, {})
    if not isinstance(state, dict):
        raise BadInputError(
            f"the optimizer state of flat tensor {flat} is not a dict", path=o.path, hint=RECOPY
        )
    return state


def _group_states(save: ZeroSave, flat: int) -> tuple[list[str], dict]:
    """Return the per-element state names of one flat tensor, and its other state (step, ...) as read.

    A per-element state (``exp_avg``) is a 1-D tensor as long as the partition (with or
    without its end padding) on every rank; a 0-d tensor (``step``) or a plain value is
    the group's, the same on every rank.
    """
    per_element, shared = [], {}
    for name, value in _state_of(save.optims[0], flat).items():
        values = [_state_of(o, flat).get(name) for o in save.optims]
        if isinstance(value, torch.Tensor) and value.dim() == 1:
            _check_per_element(save, flat, name, values)
            per_element.append(name)
        elif isinstance(value, torch.Tensor):
            shared[name] = _one_value(save, flat, name, values)
        else:
            shared[name] = value
    return per_element, shared


def _check_per_element(save: ZeroSave, flat: int, name: str, values: list) -> None:
    """Refuse a per-element state that some rank's file does not hold for its whole partition."""
    for o, v in zip(save.optims, values):
        if not isinstance(v, torch.Tensor) or v.dim() != 1 or len(v) < len(o.flat[flat]):
            raise BadInputError(
                f"optimizer state '{name}' of flat tensor {flat} is not a 1-D tensor as long "
                "as the rank's partition",
                path=o.path,
                hint=RECOPY,
            )


def _one_value(save: ZeroSave, flat: int, name: str, values: list) -> Stored:
    """Return a flat tensor's 0-d state (``step``), which every rank must hold alike."""
    value = values[0]
    if value.dim() != 0:
        raise BadInputError(
            f"optimizer state '{name}' of flat tensor {flat} is a tensor of shape "
            f"{list(value.shape)}, neither per element nor one value",
            path=save.optims[0].path,
            hint="shardckpt reads optimizers whose state is per element or per parameter "
            "(Adam, AdamW, SGD, ...)",
        )
    if not all(
        isinstance(v, torch.Tensor) and torch.equal(in_place.values(v), in_place.values(value))
        for v in values
    ):
        raise BadInputError(
            f"optimizer state '{name}' of flat tensor {flat} differs between the ranks",
            path=save.files.dir,
            hint=RECOPY,
        )
    return Stored(Whole(value.detach()), (), value.dtype, "full")


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
