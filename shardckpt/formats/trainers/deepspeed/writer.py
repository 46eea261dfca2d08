"""Writing a DeepSpeed ZeRO checkpoint for M data-parallel ranks, which ``engine.load_checkpoint`` at M loads.

DST is what ``engine.save_checkpoint(DST, tag)`` of a job at M writes: ``DST/latest``
naming the tag (SRC's), and ``DST/<tag>/`` holding

- ``mp_rank_00_model_states.pt`` (ZeRO-1/2; ZeRO-3: ``zero_pp_rank_{r}_mp_rank_00_model_states.pt``
  for every rank, parameters as 0-element placeholders): the module's state dict in the
  dtype the job trains in (the fp32 master weights cast), ``param_shapes``, frozen and tied
  parameters, the scheduler, steps, ``ds_config``, the client state;
- ``[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` for every rank r: r's partition
  of the fp32 master weights and of each per-element optimizer state, cut as DeepSpeed
  cuts them for M ranks (``write_layout``), the loss scaler.

Each process writes the files of the target ranks it acts for, filled from SRC's rows a
batch at a time, as every local writer does. The layout of the module (which entries
are buffers, frozen, tied; their dtypes) comes from SRC's own model-states file, or, for
a source that is not a DeepSpeed save, from the module ``--model`` builds
(``model_layout``); the param groups are the optimizer's (weights alone: ``--model``'s).
An HF Trainer's files beside the run are carried (``trainer_files``).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from shardckpt.codecs.foreign_pickle import MODULE, Call, Instance, Named
from shardckpt.codecs.zip_skeleton import fake_mode
from shardckpt.core.copies import copy_entry
from shardckpt.core.errors import UsageError, notice
from shardckpt.core.files import writing
from shardckpt.formats.base import Frame
from shardckpt.formats.ranks.rank_file import Fills, placeholder_whole
from shardckpt.formats.ranks.target_ranks import TargetRanksWriter, merge_frames
from shardckpt.formats.torch_save.file import skeleton_file, storage_of
from shardckpt.formats.trainers.deepspeed import names
from shardckpt.formats.trainers.deepspeed.agreement import training_dtype
from shardckpt.formats.trainers.deepspeed.model_layout import model_states
from shardckpt.formats.trainers.deepspeed.states import JOB_KEYS, ModelStates, read_model_states
from shardckpt.formats.trainers.deepspeed.trainer_files import trainer_files
from shardckpt.formats.trainers.deepspeed.write_layout import (
    FlatGroup,
    param_alignment,
    zero3_groups,
    zero12_group,
)
from shardckpt.state.model import model_params
from shardckpt.state.tree import TensorMeta, map_leaves

MODEL, OPTIM = "model", "optim"
LOSS_SCALER = Named("deepspeed.runtime.fp16.loss_scaler", "LossScaler")
DYNAMIC_LOSS_SCALER = Named("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler")
ZERO_STAGE = Named("deepspeed.runtime.zero.config", "ZeroStageEnum")
FRAGMENT_ADDRESS = Named("deepspeed.utils.tensor_fragment", "fragment_address")
# The flags DeepSpeed's optimizer saves beside its loss scaler (the reader puts them with
# it); ``clip_grad`` is the config's ``gradient_clipping``, 1.0 by default.
SCALER_FLAGS = {"dynamic_loss_scale": False, "overflow": False}
# What ``engine._common_checkpoint_state`` writes that is the job's, not the layout's.
JOB_DEFAULTS = {
    "lr_scheduler": None,
    "data_sampler": None,
    "random_ltd": None,
    "skipped_steps": 0,
    "global_steps": 0,
    "global_samples": 0,
}


def optim_file(rank: int, bf16: bool) -> str:
    """Return the name DeepSpeed gives rank ``rank``'s optimizer file."""
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def model_file(rank: int, stage: int) -> str:
    """Return the name DeepSpeed gives the model-states file (ZeRO-3: rank ``rank``'s)."""
    return (
        f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
        if stage == 3
        else "mp_rank_00_model_states.pt"
    )


WRITES_VERSION = "0.19.8"
"""The DeepSpeed release whose files this writes, named in them where SRC names none."""


@dataclass(frozen=True)
class Source:
    """What DST's layout takes from SRC: its tag and the model-states file that describes the module."""

    tag: str
    model: ModelStates
    native: bool = True
    """Whether SRC is a DeepSpeed save (else the module's layout is ``--model``'s)."""
    tag_dir: Path | None = None
    """SRC's tag directory (a DeepSpeed save)."""


def source_save(plan) -> Source:
    """Return SRC's tag and model-states file, or the module ``--model`` builds for another source."""
    from shardckpt.formats.trainers.deepspeed.detect import is_deepspeed_dir

    src = Path(plan.src)
    if src.is_dir() and is_deepspeed_dir(src):
        tag = names.tag_dir(src)
        files = names.tag_files(tag, src)
        return Source(tag.name, read_model_states(files.model[min(files.model)]), tag_dir=tag)
    if plan.flat_model is None:
        raise UsageError(
            "is not a DeepSpeed save, and --format deepspeed needs the module's layout "
            "(its buffers, frozen and tied parameters, dtypes), which a DeepSpeed save's "
            "model-states file gives",
            path=src,
            hint="pass --model pkg.module:factory building the trained model",
        )
    steps = plan.tree.get("global_steps")
    steps = steps if type(steps) is int and steps >= 0 else 0
    return Source(f"global_step{steps}", model_states(plan.flat_model.spec, src), native=False)


class DeepSpeedWriter(TargetRanksWriter):
    """A ZeRO checkpoint at M: each target rank's optimizer file (and ZeRO-3 model-states file), ``latest`` last."""

    def __init__(self, root: Path, plan):
        super().__init__(root, plan)
        self.source = source_save(plan)
        self.notes: list[str] = []
        self.carried: list[str] = []
        if self.source.tag_dir is not None:
            self.carried, notes = trainer_files(
                Path(plan.src), self.source.tag_dir, plan.world_size
            )
            self.notes += notes
        tree = plan.tree
        self.fresh = not self.source.native and OPTIM not in tree
        """Weights alone (no optimizer in SRC): the masters, and no optimizer state."""
        for key in (MODEL,) if self.fresh else (MODEL, OPTIM):
            if key not in tree or not isinstance(tree[key], dict):
                raise UsageError(
                    f"--format deepspeed needs SRC's '{key}': DeepSpeed loads the module and its "
                    "optimizer's partitions together",
                    hint="convert the whole checkpoint (no --only, --filter or --drop of it); "
                    "weights at the root of SRC go under --nest model",
                )
        self.model: dict = tree[MODEL]
        self.optim: dict = tree[OPTIM] if not self.fresh else self._fresh_optim(plan)
        config = tree.get("ds_config", self.source.model.job.get("ds_config"))
        self.config = copy.deepcopy(config) if isinstance(config, dict) else {}
        if not self.source.native:
            self.config = self._own_config()
        self.stage = self._stage()
        if plan.zero_stage is not None and plan.zero_stage != self.stage:
            # The job that loads DST runs the new stage: its saves will say so too.
            self.stage = plan.zero_stage
            self.config["zero_optimization"]["stage"] = plan.zero_stage
        self.dtype = training_dtype(self.config) or torch.float32
        self.bf16 = self.dtype == torch.bfloat16
        self._check_optimizer()
        self.groups = self._groups()
        self.flats = self._layout()
        for fqn, saved in self.source.model.module.items():
            if isinstance(saved, torch.Tensor) and not isinstance(self.model.get(fqn), TensorMeta):
                raise _missing(fqn)
        if not self.source.native:
            self._check_trained()
        self.every_copy = (names.LATEST, *self.carried)

    # ------------------------------------------------------------ what is written

    def _stage(self) -> int:
        zero = self.config.get("zero_optimization")
        stage = zero.get("stage") if isinstance(zero, dict) else None
        if stage not in (1, 2, 3):
            raise UsageError(
                f"SRC's ds_config runs ZeRO stage {stage!r}, and --format deepspeed writes "
                "stages 1, 2 and 3",
                path=self.plan.src,
                hint="convert a ZeRO-1, 2 or 3 save",
            )
        return stage

    def _fresh_optim(self, plan) -> dict:
        """Return an optimizer of no state over the trainable parameters, in --model's param groups.

        DeepSpeed partitions its fp32 masters by the job's param groups: --model's factory
        gives them as ``(module, param_groups)``; a bare module trains one group of its
        trainable parameters in ``named_parameters`` order.
        """
        source = self.source.model
        frozen = {fqn for fqn, _ in source.frozen_shapes}
        trained = [
            fqn
            for fqn in source.module
            if fqn not in source.buffers and fqn not in source.shared and fqn not in frozen
        ]
        params = model_params(plan.flat_model.spec, True)
        groups = [list(g) for g in params.groups] if params.groups else [trained]
        self.notes.append(
            "SRC holds no optimizer: DST's optimizer files hold the fp32 master weights and "
            "no optimizer state; load DST with engine.load_checkpoint(DST, "
            "load_optimizer_states=False, load_lr_scheduler_states=False)"
        )
        return {"state": {}, "param_groups": [{"params": g} for g in groups]}

    def _own_config(self) -> dict:
        """Return the ``ds_config`` written for a SRC that has none: the ZeRO stage, the module's dtype."""
        stage = self.plan.zero_stage or 2
        config: dict = {"zero_optimization": {"stage": stage}}
        module = self.source.model
        dtypes = {
            t.dtype
            for fqn, t in module.module.items()
            if t.is_floating_point() and fqn not in module.buffers
        }
        dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        if dtype in (torch.bfloat16, torch.float16):
            config["bf16" if dtype == torch.bfloat16 else "fp16"] = {"enabled": True}
        self.notes.append(
            f"SRC is not a DeepSpeed save: writing ZeRO-{stage}"
            f"{'' if self.plan.zero_stage else ' (pass --zero-stage for another)'}, the module "
            f"in {str(dtype).removeprefix('torch.')} as --model builds it"
        )
        if self.plan.tree.get("lr_scheduler") is None and OPTIM in self.plan.tree:
            self.notes.append(
                "SRC holds no DeepSpeed scheduler state (lr_scheduler): load DST with "
                "engine.load_checkpoint(DST, load_lr_scheduler_states=False)"
            )
        return config

    def _check_optimizer(self) -> None:
        """Refuse a job DeepSpeed runs with its ``BF16_Optimizer`` (ZeRO-1, bf16, fp32 gradient accumulation)."""
        types = self.config.get("data_types")
        accum = types.get("grad_accum_dtype") if isinstance(types, dict) else None
        offload = self._zero("offload_optimizer", None)
        if self.stage == 1 and self.bf16 and accum in ("fp32", "float32") and not offload:
            raise UsageError(
                "SRC's ds_config runs ZeRO-1 in bf16 with fp32 gradient accumulation, which "
                "DeepSpeed trains with its BF16_Optimizer, whose files --format deepspeed does "
                "not write",
                path=self.plan.src,
                hint="write --to sharded (DCP) or --to full instead",
            )

    def _zero(self, key: str, default):
        zero = self.config.get("zero_optimization")
        return zero.get(key, default) if isinstance(zero, dict) else default

    def _groups(self) -> list[list[tuple[str, tuple[int, ...]]]]:
        """Return each param group's parameters in the optimizer's order, with their shapes; refuse what cannot be laid out."""
        if self._zero("round_robin_gradients", False):
            raise UsageError(
                "SRC ran with zero_optimization.round_robin_gradients, whose flat order "
                "depends on the world size: --format deepspeed does not write it",
                path=self.plan.src,
                hint="write --to sharded (DCP) or --to full instead",
            )
        groups = self.optim.get("param_groups")
        if not isinstance(groups, list) or not all(
            isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups
        ):
            raise UsageError(
                "--format deepspeed needs the optimizer's param groups, and the tree has none",
                hint="convert the whole checkpoint, with its optimizer",
            )
        out = []
        for group in groups:
            shapes = []
            for fqn in group["params"]:
                meta = self.model.get(fqn) if isinstance(fqn, str) else None
                if not isinstance(meta, TensorMeta):
                    raise UsageError(
                        f"--format deepspeed needs the fp32 master weights of {fqn!r} in "
                        "'model', and the tree does not hold them",
                        hint="convert the whole checkpoint, keyed by FQN (no --optim-keys id), "
                        "without --rename or --drop",
                    )
                shapes.append((fqn, tuple(meta.shape)))
            out.append(shapes)
        return out

    def _check_trained(self) -> None:
        """Refuse an optimizer that does not train exactly the module's parameters that require grad."""
        source = self.source.model
        trained = [fqn for group in self.groups for fqn, _ in group]
        frozen = {fqn for fqn, _ in source.frozen_shapes}
        params = [
            fqn
            for fqn in source.module
            if fqn not in source.buffers and fqn not in source.shared and fqn not in frozen
        ]
        for fqn in params:
            if fqn not in trained:
                raise UsageError(
                    f"the module --model builds trains '{fqn}' (it requires grad), and SRC's "
                    "optimizer does not hold it",
                    hint="check --model against `shardckpt inspect SRC`",
                )
        for fqn in trained:
            if fqn not in params:
                raise UsageError(
                    f"SRC's optimizer trains '{fqn}', which the module --model builds does not "
                    "train (a buffer, a frozen or tied parameter, or no entry)",
                    hint="check --model against `shardckpt inspect SRC`",
                )

    def _layout(self) -> list[FlatGroup]:
        world = self.plan.world_size
        if self.stage == 3:
            flats: list[FlatGroup] = []
            size = self._zero("sub_group_size", 1_000_000_000)
            for g, group in enumerate(self.groups):
                flats += zero3_groups(g, len(flats), group, world, size)
            return flats
        aligned = bool(self._zero("parameter_alignment", False))
        unit = param_alignment(self.dtype.itemsize, aligned)
        return [zero12_group(g, group, world, unit) for g, group in enumerate(self.groups)]

    # ------------------------------------------------------------ framing

    def frame_rank(self, rank: int) -> Frame:
        tag = self.root / self.source.tag
        with writing(tag):
            tag.mkdir(exist_ok=True)
        frames = [self._frame_optim(rank, tag)]
        if self.stage == 3 or rank == 0:
            frames.append(self._frame_model(rank, tag))
        return merge_frames(frames)

    def _frame_optim(self, rank: int, tag: Path) -> Frame:
        fills: Fills = {}
        with fake_mode():
            osd = self._optimizer_state(rank, fills)
            state = {
                "optimizer_state_dict": osd,
                "ds_config": self.config,
                "ds_version": self._version(),
            }
        name = optim_file(rank, self.bf16)
        return skeleton_file(tag / name, state, fills, f"{self.source.tag}/{name}", MODULE)

    def _version(self) -> str:
        version = self.plan.tree.get("ds_version", self.source.model.job.get("ds_version"))
        return version if isinstance(version, str) else WRITES_VERSION

    def _optimizer_state(self, rank: int, fills: Fills) -> dict:
        """Return rank ``rank``'s ``optimizer.state_dict()`` of placeholders, as DeepSpeed's ZeRO optimizer saves it."""
        state, masters = {}, []
        for f, flat in enumerate(self.flats):
            masters.append(self._flat(flat, rank, flat.stored[rank], fills, self._master))
            state[f] = self._flat_state(flat, rank, fills)
        hypers = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": []}
            for g in self.optim["param_groups"]
        ]
        for f, flat in enumerate(self.flats):
            hypers[flat.group]["params"].append(f)
        base = {"state": state, "param_groups": hypers}
        scaler, flags = self._scaler()
        if self.stage == 3:
            return {
                "zero_stage": Call(ZERO_STAGE, (3,)),
                "loss_scaler": scaler,
                "dynamic_loss_scale": flags["dynamic_loss_scale"],
                "overflow": flags["overflow"],
                "partition_count": self.plan.world_size,
                "optimizer_state_dict": base,
                "fp32_flat_groups": masters,
            }
        return {
            "loss_scaler": scaler,
            **flags,
            "base_optimizer_state": base,
            "single_partition_of_fp32_groups": masters,
            "zero_stage": Call(ZERO_STAGE, (self.stage,)),
            "group_paddings": [flat.end_paddings[rank] for flat in self.flats],
            "param_alignment_paddings": [list(flat.paddings) for flat in self.flats],
            "partition_count": [self.plan.world_size] * len(self.flats),
            "ds_version": self._version(),
            "param_slice_mappings": [self._slices(flat, rank) for flat in self.flats],
        }

    def _master(self, fqn: str) -> TensorMeta:
        return self.model[fqn]

    def _flat(self, flat: FlatGroup, rank: int, size: int, fills: Fills, meta_of) -> torch.Tensor:
        """Return a placeholder of ``size`` elements: rank ``rank``'s flat tensor of ``meta_of(fqn)`` for each parameter."""
        first = meta_of(flat.shapes[0][0]) if flat.shapes else None
        dtype = first.dtype if first is not None else torch.float32
        out = torch.empty(size, dtype=dtype)
        entries = []
        for p in flat.placed:
            meta = meta_of(p.fqn)
            for piece in p.pieces:
                if piece.rank == rank and piece.numel:
                    at = piece.at * dtype.itemsize
                    entries.append((meta.key, piece.start, piece.start + piece.numel, at))
        fills[storage_of(out)] = entries
        return out

    def _flat_state(self, flat: FlatGroup, rank: int, fills: Fills) -> dict:
        """Return the base optimizer's state of rank ``rank``'s flat tensor: per-element state cut as the masters, the rest the group's."""
        entries = [self.optim["state"].get(fqn, {}) for fqn, _ in flat.shapes]
        if not entries or not entries[0]:
            if any(entries):
                raise _uneven_state(flat.shapes[0][0])
            return {}
        out: dict = {}
        for name, value in entries[0].items():
            if any(name not in e for e in entries):
                raise _uneven_state(flat.shapes[0][0])
            if isinstance(value, TensorMeta) and value.shape == tuple(
                self.model[flat.shapes[0][0]].shape
            ):
                out[name] = self._flat(
                    flat,
                    rank,
                    flat.partition,
                    fills,
                    lambda fqn, n=name: self.optim["state"][fqn][n],
                )
            elif isinstance(value, TensorMeta):
                out[name] = placeholder_whole(fills, value)
            else:
                out[name] = value
        return out

    def _slices(self, flat: FlatGroup, rank: int) -> OrderedDict:
        """Return ``param_slice_mappings`` of rank ``rank``'s partition: where each parameter's slice lies."""
        return OrderedDict(
            (p.fqn, Instance(FRAGMENT_ADDRESS, {"numel": piece.numel, "start": piece.at}))
            for p in flat.placed
            for piece in p.pieces
            if piece.rank == rank
        )

    def _scaler(self) -> tuple[Instance, dict]:
        """Return the loss scaler object and the flags saved beside it, from SRC's (or a static scale of 1)."""
        values = self.plan.tree.get("loss_scaler")
        values = dict(values) if isinstance(values, dict) else {"cur_scale": 1.0, "dynamic": False}
        defaults = {**SCALER_FLAGS, "clip_grad": float(self.config.get("gradient_clipping", 1.0))}
        flags = {k: values.pop(k, v) for k, v in defaults.items()}
        if isinstance(values.get("dtype"), str) and values["dtype"].startswith("torch."):
            values["dtype"] = getattr(torch, values["dtype"].removeprefix("torch."))
        cls = DYNAMIC_LOSS_SCALER if values.get("dynamic") else LOSS_SCALER
        return Instance(cls, values), flags

    def _frame_model(self, rank: int, tag: Path) -> Frame:
        """Write the model-states file (ZeRO-3: rank ``rank``'s) and return the regions that fill it."""
        fills: Fills = {}
        casts: dict[int, torch.dtype] = {}
        source = self.source.model
        frozen = self._frozen_shapes()
        with fake_mode():
            module = OrderedDict()
            for fqn, saved in source.module.items():
                meta = self.model.get(fqn)
                if not isinstance(saved, torch.Tensor):
                    module[fqn] = saved
                    continue
                if self.stage == 3 and fqn not in source.buffers:
                    module[fqn] = torch.empty(0, dtype=saved.dtype)
                    continue
                module[fqn] = self._cast_whole(meta, saved.dtype, fills, casts)
            fragments = None
            if self.stage >= 2:
                fragments = OrderedDict(
                    (fqn, self._frozen(fqn, rank, source, fills, casts)) for fqn in frozen
                )
            state = {
                "module": module,
                "buffer_names": list(source.buffers),
                "optimizer": None,
                "param_shapes": [
                    OrderedDict((fqn, torch.Size(shape)) for fqn, shape in flat.shapes)
                    for flat in self.flats
                ],
                "frozen_param_shapes": (
                    OrderedDict((fqn, torch.Size(shape)) for fqn, shape in frozen.items())
                    if self.stage >= 2
                    else None
                ),
                # DeepSpeed finds tied parameters on global rank 0 only.
                "shared_params": dict(source.shared) if rank == 0 else {},
                "frozen_param_fragments": fragments,
                **self._job(fills),
                "dp_world_size": self.plan.world_size,
                "mp_world_size": 1,
                "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
                "ds_config": self.config,
                "ds_version": self._version(),
                **self._client(fills),
            }
        name = model_file(rank, self.stage)
        frame = skeleton_file(tag / name, state, fills, f"{self.source.tag}/{name}", MODULE)
        return _with_casts(frame, fills, casts)

    def _frozen_shapes(self) -> dict[str, tuple[int, ...]]:
        """Return the module's parameters outside the optimizer, as ZeRO-2/3 list them.

        A ZeRO-1 save lists none: they are the module's parameters that are neither
        trained, buffers nor tied to another.
        """
        source = self.source.model
        if source.frozen_shapes:
            return dict(source.frozen_shapes)
        trained = {fqn for flat in self.flats for fqn, _ in flat.shapes}
        return {
            fqn: tuple(meta.shape)
            for fqn in source.module
            if fqn not in trained
            and fqn not in source.buffers
            and fqn not in source.shared
            and isinstance(meta := self.model.get(fqn), TensorMeta)
        }

    def _cast_whole(
        self, meta: TensorMeta, dtype: torch.dtype, fills: Fills, casts: dict[int, torch.dtype]
    ) -> torch.Tensor:
        """Return a placeholder of all of ``meta`` in ``dtype``, noted in ``fills`` (and ``casts`` where cast)."""
        out = torch.empty(meta.shape, dtype=dtype)
        fills[storage_of(out)] = [(meta.key, 0, meta.numel, 0)]
        if dtype != meta.dtype:
            casts[storage_of(out)] = dtype
        return out

    def _frozen(
        self, fqn: str, rank: int, source: ModelStates, fills: Fills, casts: dict[int, torch.dtype]
    ) -> torch.Tensor:
        """Return a frozen parameter as ``frozen_param_fragments`` holds it: whole, or ZeRO-3 rank ``rank``'s part."""
        meta = self.model[fqn]
        saved = source.frozen_fragments.get(fqn, source.module.get(fqn))
        dtype = saved.dtype if isinstance(saved, torch.Tensor) else self.dtype
        if self.stage < 3:
            return self._cast_whole(meta, dtype, fills, casts)
        world = self.plan.world_size
        part = -(-meta.numel // world)
        start, stop = min(rank * part, meta.numel), min((rank + 1) * part, meta.numel)
        out = torch.empty(part, dtype=dtype)
        fills[storage_of(out)] = [(meta.key, start, stop, 0)]
        if dtype != meta.dtype:
            casts[storage_of(out)] = dtype
        return out

    def _job(self, fills: Fills) -> dict:
        tree = self.plan.tree
        return {k: _placeholders(tree.get(k, v), fills) for k, v in JOB_DEFAULTS.items()}

    def _client(self, fills: Fills) -> dict:
        client = self.plan.tree.get("client_state")
        if not isinstance(client, dict):
            return {}
        reserved = [k for k in client if k in JOB_KEYS or k in ("module", "optimizer")]
        if reserved:
            raise UsageError(
                f"the client state's key {reserved[0]!r} is one DeepSpeed keeps for itself",
                hint="--drop it (client_state." + str(reserved[0]) + ")",
            )
        return {k: _placeholders(v, fills) for k, v in client.items()}

    def written_tree(self, tree: dict) -> dict:
        """Return ``tree`` as DST reads back: the job's values, ``ds_config`` and loss scaler the files hold.

        At another ZeRO stage the config says that stage (and ZeRO-3 saves no ``clip_grad``);
        from a source that is not a DeepSpeed save, the values DeepSpeed's files always hold
        (steps, config, version, a loss scaler of 1) are there too.
        """
        out = dict(tree)
        for key, default in JOB_DEFAULTS.items():
            value = tree.get(key, default)
            if value is None:
                out.pop(key, None)
            else:
                out[key] = value
        out["ds_config"] = self.config
        out["ds_version"] = self._version()
        if self.fresh:
            out[OPTIM] = self.optim
        scaler, flags = self._scaler()
        saved = tree.get("loss_scaler")
        values = (
            {k: v for k, v in saved.items() if k not in flags}
            if isinstance(saved, dict)
            else dict(scaler.state)
        )
        out["loss_scaler"] = {**values, **self._saved_flags(flags)}
        return out

    def _saved_flags(self, flags: dict) -> dict:
        """Return the flags DeepSpeed saves beside the loss scaler at the stage written (ZeRO-3: no ``clip_grad``)."""
        return {k: v for k, v in flags.items() if not (self.stage == 3 and k == "clip_grad")}

    def finish(self) -> None:
        path = self.root / names.LATEST
        with writing(path), open(path, "w", encoding="utf-8") as f:
            f.write(self.source.tag)
        src = Path(self.plan.src)
        for name in self.carried:
            copy_entry(src / name, self.root / name, src)
        for note in self.notes:
            notice(note)


def _placeholders(value: object, fills: Fills) -> object:
    """Return ``value`` with every tensor leaf a placeholder noted in ``fills`` (inside ``fake_mode``)."""
    return map_leaves(
        value,
        lambda _p, leaf: placeholder_whole(fills, leaf) if isinstance(leaf, TensorMeta) else leaf,
    )


def _with_casts(frame: Frame, fills: Fills, casts: dict[int, torch.dtype]) -> Frame:
    """Return ``frame`` with the regions of the placeholders in ``casts`` written in their dtype."""
    if not casts:
        return frame
    cast_of = {}
    for storage, dtype in casts.items():
        for key, *_ in fills[storage]:
            cast_of.setdefault(key, dtype)
    regions = [replace(r, cast=cast_of[r.key]) if r.key in cast_of else r for r in frame.regions]
    return Frame(regions, frame.records, frame.pieces, frame.files)


def _uneven_state(fqn: str) -> UsageError:
    return UsageError(
        f"the parameters of the flat group of '{fqn}' differ in their optimizer state, which "
        "one flat partition's state cannot hold",
        hint="convert a checkpoint whose every trainable parameter has the same state",
    )


def _missing(fqn: str) -> UsageError:
    return UsageError(
        f"--format deepspeed writes the module's '{fqn}', and the tree does not hold it",
        hint="convert the whole checkpoint, without --drop or --filter of 'model'",
    )
