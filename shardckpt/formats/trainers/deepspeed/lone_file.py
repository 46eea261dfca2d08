"""One file of a DeepSpeed checkpoint passed alone: which directory holds the whole checkpoint.

A ZeRO save is every rank's files together: a rank's optimizer file holds a slice of
one flat concatenation of all parameters, and a ZeRO-3 model-states file holds each
parameter as a 0-element placeholder. Read alone, either would give slices or nothing
where the save has whole tensors, so shardckpt names the directory to pass instead.
Imports nothing of the DeepSpeed reader: ``torch_file`` asks this module too.
"""

from __future__ import annotations

import math
from pathlib import Path

from shardckpt.core.errors import BadInputError, ShardckptError
from shardckpt.formats.trainers.deepspeed.names import (
    LATEST,
    MODEL_FILE,
    OPTIM_FILE,
    is_deepspeed_file,
    read_pointer,
)
from shardckpt.state.tree import is_tensor_leaf


def whole_checkpoint(path: Path) -> Path:
    """Return the directory to pass for a file of a save: the run directory when its ``latest`` names the save."""
    tag = path.parent
    run = tag.parent
    try:
        # Only a hint: a 'latest' that is not a small regular file of the run names nothing.
        if (run / LATEST).is_file() and read_pointer(run / LATEST, run) == tag.name:
            return run
    except ShardckptError:
        pass
    return tag


def _what(name: str) -> str:
    if (m := OPTIM_FILE.fullmatch(name)) is not None:
        return f"rank {int(m.group(2))}'s slice of the fp32 weights and optimizer state"
    m = MODEL_FILE.fullmatch(name)
    if m is not None and m.group(1) is not None:
        return f"rank {int(m.group(1))}'s model states, every ZeRO-3 parameter a placeholder"
    return "the module's 16-bit weights and the layout of the flat partitions, not the fp32 master weights or the optimizer"


def pointer_hint(path: Path) -> str | None:
    """Return the hint naming the directory that holds the whole checkpoint, for a DeepSpeed file; else None."""
    if not is_deepspeed_file(path.name):
        return None
    return (
        f"pass the directory '{whole_checkpoint(path)}', which shardckpt reads as one "
        "DeepSpeed checkpoint (every rank's files, no pickle run)"
    )


def refuse_lone_file(path: Path) -> None:
    """Raise for a DeepSpeed checkpoint file passed as a source on its own; return for any other file."""
    hint = pointer_hint(path)
    if hint is not None:
        raise BadInputError(
            f"is one file of a DeepSpeed ZeRO checkpoint ({_what(path.name)})", path=path, hint=hint
        )


def refuse_placeholders(path: Path, obj: object) -> None:
    """Raise when ``obj`` (a loaded ``torch.save`` dict) is a ZeRO-3 model-states file of placeholders.

    Its ``module`` holds a 0-element tensor for every parameter whose shape
    ``param_shapes`` (or ``frozen_param_shapes``) gives as larger: read as a torch file it
    would convert to empty weights.
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("module"), dict):
        return
    shapes: dict = {}
    for group in obj.get("param_shapes") or []:
        if isinstance(group, dict):
            shapes.update(group)
    if isinstance(obj.get("frozen_param_shapes"), dict):
        shapes.update(obj["frozen_param_shapes"])
    for fqn, value in obj["module"].items():
        shape = shapes.get(fqn)
        if (
            is_tensor_leaf(value)
            and value.numel() == 0
            and isinstance(shape, tuple)
            and math.prod(shape) > 0
        ):
            raise BadInputError(
                f"'module.{fqn}' is a placeholder of 0 elements for a parameter of shape "
                f"{list(shape)}: a ZeRO-3 model-states file holds no weights",
                path=path,
                hint=f"pass the directory '{whole_checkpoint(path)}', which holds every rank's "
                "partition of them",
            )
