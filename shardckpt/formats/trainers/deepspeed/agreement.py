"""The files of one ZeRO save agree with each other and with the module they describe.

Every file DeepSpeed writes for a save carries the job's ``ds_config`` and ``ds_version``;
the optimizer files of one save carry the same param groups and loss scaler; the
module's weights are in the dtype the config trains in, and have the shapes
``param_shapes`` lists. A tag directory holding files of two runs (an fp32 run's
optimizer file beside an fp16 run's, a bf16 run's model-states file in an fp32 run), or
a ``param_shapes`` that lies, would give a tree mixing both, or tensors written
transposed: each is refused here, naming both files, before anything is read.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardckpt.core.errors import BadInputError
from shardckpt.formats.trainers.deepspeed.states import ModelStates, OptimStates

RECOPY = "the files are not of one save; re-copy the checkpoint"


def _mixed(path, what: str, other) -> BadInputError:
    return BadInputError(
        f"holds another {what} than '{other}': the two files are of different saves",
        path=path,
        hint=RECOPY,
    )


def _same(a: object, b: object) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values that do not compare (tensors) are not the same
        return False


def training_dtype(config: object) -> torch.dtype | None:
    """Return the dtype ``ds_config`` trains the module in; None when the config does not say."""
    if not isinstance(config, dict):
        return None
    for key, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        section = config.get(key)
        if isinstance(section, dict) and section.get("enabled") is True:
            return dtype
    return torch.float32


def check_model_states(models: Sequence[ModelStates]) -> None:
    """Refuse model-states files that disagree on the job, or a module that contradicts its shapes."""
    first = models[0]
    for m in models[1:]:
        for key in ("ds_version", "ds_config"):
            if not _same(m.job.get(key), first.job.get(key)):
                raise _mixed(m.path, f"'{key}'", first.path)
    for m in models:
        _check_module(m)


def _check_module(model: ModelStates) -> None:
    """Refuse a module whose parameters are not what ``param_shapes`` and ``ds_config`` say."""
    dtype = training_dtype(model.job.get("ds_config"))
    listed = [*(s for shapes in model.param_shapes for s in shapes), *model.frozen_shapes]
    for fqn, shape in listed:
        value = model.module.get(fqn)
        if not isinstance(value, torch.Tensor):
            continue
        if dtype is not None and value.is_floating_point() and value.dtype != dtype:
            raise BadInputError(
                f"holds '{fqn}' as {value.dtype}, but its ds_config trains in {dtype}: "
                "the file is not of the save its config describes",
                path=model.path,
                hint=RECOPY,
            )
        # ZeRO-3 keeps a 0-element placeholder in the module: its shape says nothing.
        if value.numel() and tuple(value.shape) != shape:
            raise BadInputError(
                f"lists '{fqn}' as {list(shape)} in param_shapes, but its module holds it as "
                f"{list(value.shape)}: the partitions would be cut into the wrong shape",
                path=model.path,
                hint="the file was changed after DeepSpeed wrote it; re-copy the checkpoint",
            )


def check_optim_states(optims: Sequence[OptimStates], model: ModelStates) -> None:
    """Refuse optimizer files that are not of the save ``model`` is: config, version, groups, scaler."""
    first = optims[0]
    for o in optims:
        for key, mine, theirs in (
            ("ds_version", o.ds_version, model.job.get("ds_version")),
            ("ds_config", o.ds_config, model.job.get("ds_config")),
        ):
            if mine is not None and not _same(mine, theirs):
                raise _mixed(o.path, f"'{key}'", model.path)
    for o in optims[1:]:
        if not _same(o.param_groups, first.param_groups):
            raise _mixed(o.path, "optimizer param_groups", first.path)
        if not _same(o.scaler, first.scaler):
            raise _mixed(o.path, "loss scaler", first.path)
