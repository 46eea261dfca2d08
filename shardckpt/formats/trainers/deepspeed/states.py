"""The two kinds of file of a ZeRO save, read and checked field by field.

``ModelStates`` is a ``*_model_states.pt``: the module's state dict (ZeRO-3: parameters
as 0-element placeholders), which of its entries are buffers, the names and shapes of
the parameters in the flat partitions, frozen and shared (tied) parameters, and the rest
of the job's state (scheduler, steps, config, client state). ``OptimStates`` is one
rank's ``*_optim_states.pt``: its fp32 partitions, the base optimizer's state of them,
and the paddings and counts that say how the partitions were cut. A field that is not
what DeepSpeed writes is refused with the file and the field named.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from shardckpt.core.errors import BadInputError
from shardckpt.formats.trainers.deepspeed.unpickle import (
    FragmentAddress,
    LossScalerState,
    load_dict_file,
)

# What DeepSpeed's engine writes into a model-states file besides the client state
# (``DeepSpeedEngine._common_checkpoint_state``); the layout keys are not the job's state.
LAYOUT_KEYS = (
    "module",
    "buffer_names",
    "optimizer",
    "param_shapes",
    "frozen_param_shapes",
    "shared_params",
    "frozen_param_fragments",
    "dp_world_size",
    "mp_world_size",
    "checkpoint_parallel_dimensions",
    "universal_checkpoint_info",
)
JOB_KEYS = (
    "lr_scheduler",
    "data_sampler",
    "random_ltd",
    "skipped_steps",
    "global_steps",
    "global_samples",
    "ds_config",
    "ds_version",
)
_DAMAGED = "the file is not one DeepSpeed wrote, or was changed after; re-copy the checkpoint"

Shapes = tuple[tuple[str, tuple[int, ...]], ...]


def bad(path: Path, what: str) -> BadInputError:
    """Return the error for a file whose field ``what`` is not as DeepSpeed writes it."""
    return BadInputError(what, path=path, hint=_DAMAGED)


def _shapes(path: Path, field: str, value: object) -> Shapes:
    """Return an ``{fqn: torch.Size}`` mapping as ``((fqn, shape), ...)``; refuse anything else."""
    if not isinstance(value, dict):
        raise bad(path, f"'{field}' is a {type(value).__name__}, not a mapping of names to shapes")
    out = []
    for name, shape in value.items():
        if (
            type(name) is not str
            or not isinstance(shape, tuple)
            or not all(type(s) is int and s >= 0 for s in shape)
        ):
            raise bad(path, f"'{field}' maps {name!r} to {shape!r}, not to a shape")
        out.append((name, tuple(shape)))
    return tuple(out)


@dataclass(frozen=True)
class ModelStates:
    """One ``*_model_states.pt``, checked."""

    path: Path
    module: dict
    """The module's state dict as saved (memory-mapped; ZeRO-3: parameters are placeholders)."""
    buffers: tuple[str, ...]
    param_shapes: tuple[Shapes, ...]
    """The parameters of each flat group (ZeRO-3: sub-group), in flat order."""
    frozen_shapes: Shapes
    frozen_fragments: dict
    """Frozen parameters (ZeRO-2: whole; ZeRO-3: this rank's part), by name."""
    shared: dict[str, str]
    """Tied parameters: the name not stored -> the name holding the data."""
    job: dict
    """The job's state DeepSpeed saves: scheduler, steps, config (``JOB_KEYS`` present)."""
    client: dict
    """What the job passed as ``client_state``."""
    dp_world_size: int | None = None
    """The number of data-parallel ranks that saved, where the file says (``dp_world_size``)."""

    @property
    def trainable(self) -> list[str]:
        """Return the names of the parameters in the flat partitions, in flat order."""
        return [fqn for shapes in self.param_shapes for fqn, _ in shapes]


def read_model_states(path: Path) -> ModelStates:
    """Return the model-states file at ``path``, read with stand-ins and checked."""
    sd = load_dict_file(path)
    if "module" not in sd or "param_shapes" not in sd or "buffer_names" not in sd:
        missing = next(k for k in ("module", "param_shapes", "buffer_names") if k not in sd)
        raise BadInputError(
            f"has no '{missing}': not a ZeRO model-states file",
            path=path,
            hint="pass the directory DeepSpeed's save_checkpoint wrote",
        )
    module, shapes = sd["module"], sd["param_shapes"]
    if sd.get("optimizer") is not None or shapes is None:
        raise BadInputError(
            "is a model-states file of a run without ZeRO (the optimizer is in it, no "
            "param_shapes)",
            path=path,
            hint="read it as a torch file: --from torch",
        )
    if not isinstance(module, dict) or not all(type(k) is str for k in module):
        raise bad(path, "'module' is not a state dict")
    if not isinstance(shapes, list):
        raise bad(path, "'param_shapes' is not a list of one mapping per group")
    buffers = sd["buffer_names"]
    if not isinstance(buffers, list) or not all(type(b) is str for b in buffers):
        raise bad(path, "'buffer_names' is not a list of names")
    shared = sd.get("shared_params") or {}
    if not isinstance(shared, dict) or not all(
        type(k) is str and type(v) is str for k, v in shared.items()
    ):
        raise bad(path, "'shared_params' is not a mapping of names to names")
    fragments = sd.get("frozen_param_fragments") or {}
    if not isinstance(fragments, dict) or not all(
        type(k) is str and isinstance(v, torch.Tensor) for k, v in fragments.items()
    ):
        raise bad(path, "'frozen_param_fragments' is not a mapping of names to tensors")
    return ModelStates(
        path=path,
        module=module,
        buffers=tuple(buffers),
        param_shapes=tuple(_shapes(path, f"param_shapes[{i}]", s) for i, s in enumerate(shapes)),
        frozen_shapes=_shapes(path, "frozen_param_shapes", sd.get("frozen_param_shapes") or {}),
        frozen_fragments=fragments,
        shared=shared,
        job={k: sd[k] for k in JOB_KEYS if k in sd},
        client={k: v for k, v in sd.items() if k not in LAYOUT_KEYS and k not in JOB_KEYS},
        dp_world_size=ws if type(ws := sd.get("dp_world_size")) is int else None,
    )


@dataclass(frozen=True)
class OptimStates:
    """One rank's ``*_optim_states.pt``, checked."""

    path: Path
    stage: int
    """1, 2 or 3 (``BF16_Optimizer``, which saves no stage, runs ZeRO-1)."""
    lean: bool
    """Whether the fp32 partitions are saved without their end padding (``DeepSpeedZeroOptimizer``)."""
    world_size: int
    flat: tuple[torch.Tensor, ...]
    """This rank's fp32 partition of each group (ZeRO-3: of each sub-group), 1-D."""
    paddings: tuple[int, ...]
    """ZeRO-1/2: the padding at the end of this rank's partition of each group."""
    alignment: tuple[tuple[int, ...], ...] | None
    """ZeRO-1/2: the padding after each parameter of each group, where saved."""
    fragments: tuple[dict[str, tuple[int, int]], ...] | None
    """ZeRO-1/2: ``param_slice_mappings`` as ``{fqn: (numel, start)}`` per group, where saved."""
    state: dict
    """The base optimizer's ``state``: per flat tensor index, its state by name."""
    param_groups: tuple[dict, ...]
    scaler: dict
    """The loss scaler's attributes and DeepSpeed's flags (``dynamic_loss_scale``, ...)."""
    ds_config: object = None
    """The job's config, as every file of a save carries it."""
    ds_version: object = None


def _int_list(path: Path, field: str, value: object) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
        raise bad(path, f"'{field}' is not a list of counts")
    return tuple(value)


def _tensors(path: Path, field: str, value: object) -> tuple[torch.Tensor, ...]:
    if not isinstance(value, list) or not all(
        isinstance(t, torch.Tensor) and t.dim() == 1 for t in value
    ):
        raise bad(path, f"'{field}' is not a list of 1-D tensors")
    return tuple(t.detach() for t in value)


def world_size_of(path: Path, value: object) -> int:
    counts = value if isinstance(value, list) else [value]
    if not counts or not all(type(c) is int and c > 0 for c in counts):
        raise bad(path, "'partition_count' is not a number of ranks")
    if len(set(counts)) > 1:
        raise BadInputError(
            f"partitions its param groups over different numbers of ranks ({counts}): an "
            "expert-parallel (MoE) save",
            path=path,
            hint="shardckpt reads data-parallel ZeRO checkpoints, without expert parallelism",
        )
    return counts[0]


def _base(path: Path, value: object) -> tuple[dict, tuple[dict, ...]]:
    """Return the base optimizer's ``(state, param_groups)``; refuse DeepSpeed's elastic form."""
    if isinstance(value, list):
        raise BadInputError(
            "holds its optimizer state in ZeRO's elastic form (per group, without "
            "param_groups), which the job's hyper-parameters cannot be read from",
            path=path,
            hint="save with zero_optimization.elastic_checkpoint false (DeepSpeed's default)",
        )
    if (
        not isinstance(value, dict)
        or not isinstance(value.get("state"), dict)
        or not isinstance(value.get("param_groups"), list)
        or not all(isinstance(g, dict) for g in value["param_groups"])
    ):
        raise bad(path, "the base optimizer's state dict has no 'state' and 'param_groups'")
    return value["state"], tuple(value["param_groups"])


def _fragments(path: Path, value: object) -> tuple[dict[str, tuple[int, int]], ...]:
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise bad(path, "'param_slice_mappings' is not a list of one mapping per group")
    out = []
    for mapping in value:
        if not all(type(k) is str and isinstance(v, FragmentAddress) for k, v in mapping.items()):
            raise bad(
                path, "'param_slice_mappings' maps a name to something not a fragment_address"
            )
        out.append({k: (v.numel, v.start) for k, v in mapping.items()})
    return tuple(out)


def scaler_of(osd: dict) -> dict:
    """Return the loss scaler's saved attributes and DeepSpeed's flags beside it, as plain values."""
    scaler = osd.get("loss_scaler")
    values = dict(scaler.values) if isinstance(scaler, LossScalerState) else {}
    for key in ("dynamic_loss_scale", "overflow", "clip_grad"):
        if key in osd and isinstance(osd[key], (bool, int, float)):
            values[key] = osd[key]
    return values


def _fp32(path: Path, field: str, flat: tuple[torch.Tensor, ...], state: dict) -> None:
    """Refuse partitions, or the base optimizer's moments of them, that are not fp32.

    DeepSpeed keeps its master weights and their optimizer state in fp32 whatever the
    module trains in; anything else would be cast silently on the way to DST.
    """
    for t in flat:
        if t.dtype != torch.float32:
            raise bad(path, f"'{field}' holds {t.dtype} partitions, where DeepSpeed keeps fp32")
    for index, values in state.items():
        for name, value in values.items() if isinstance(values, dict) else ():
            if isinstance(value, torch.Tensor) and name != "step" and value.dtype != torch.float32:
                raise bad(
                    path,
                    f"the base optimizer's '{name}' of flat group {index} is {value.dtype}, "
                    "where DeepSpeed keeps fp32",
                )


def read_optim_states(path: Path) -> OptimStates:
    """Return one rank's optimizer file at ``path``, read with stand-ins and checked."""
    sd = load_dict_file(path)
    osd = sd.get("optimizer_state_dict")
    if not isinstance(osd, dict):
        raise bad(path, "has no 'optimizer_state_dict'")
    stage = osd.get("zero_stage")
    if stage == 3:
        state, groups = _base(path, osd.get("optimizer_state_dict"))
        flat = _tensors(path, "fp32_flat_groups", osd.get("fp32_flat_groups"))
        paddings: tuple[int, ...] = ()
        alignment = fragments = None
    elif stage in (1, 2, None) and "single_partition_of_fp32_groups" in osd:
        state, groups = _base(path, osd.get("base_optimizer_state"))
        flat = _tensors(
            path, "single_partition_of_fp32_groups", osd["single_partition_of_fp32_groups"]
        )
        paddings = _int_list(path, "group_paddings", osd.get("group_paddings"))
        alignment = (
            tuple(_int_list(path, "param_alignment_paddings", a) for a in osd[k])
            if isinstance(osd.get(k := "param_alignment_paddings"), list)
            else None
        )
        fragments = _fragments(path, osd[k]) if (k := "param_slice_mappings") in osd else None
        if len(paddings) != len(flat):
            raise bad(path, f"'group_paddings' has {len(paddings)} entries for {len(flat)} groups")
    else:
        raise BadInputError(
            f"is an optimizer file of ZeRO stage {stage}, which shardckpt does not read",
            path=path,
            hint="shardckpt reads ZeRO stages 1, 2 and 3",
        )
    _fp32(
        path, "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups", flat, state
    )
    return OptimStates(
        path=path,
        stage=1 if stage is None else stage,
        lean=stage is not None,
        world_size=world_size_of(path, osd.get("partition_count")),
        flat=flat,
        paddings=paddings,
        alignment=alignment,
        fragments=fragments,
        state=state,
        param_groups=groups,
        scaler=scaler_of(osd),
        ds_config=sd.get("ds_config"),
        ds_version=sd.get("ds_version"),
    )
