"""A module's layout as a DeepSpeed save describes it, from the model ``--model`` builds.

A DeepSpeed save says in its model-states file which of the module's entries are
buffers, frozen parameters and tied ones, and in which dtype the module trains. A
source from elsewhere (FSDP2's DCP, torch files) says none of that: the module the
user's factory builds on the meta device does, as DeepSpeed's engine would read it
from the same module (``_get_buffer_names``, ``_get_shared_params``, the parameters
outside the optimizer).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from shardckpt.core.errors import UsageError
from shardckpt.formats.trainers.deepspeed.states import ModelStates
from shardckpt.state.model import build_model
from shardckpt.state.tree import clean_fqn


def model_states(spec: str, path: Path, clean_fqns: bool = True) -> ModelStates:
    """Return what a model-states file of the module ``spec`` builds would list (no job, no data).

    ``module`` holds a meta tensor of each entry's shape and dtype, in ``state_dict`` order.
    """
    name = clean_fqn if clean_fqns else str
    module, _ = build_model(spec)
    try:
        state = module.state_dict(keep_vars=True)
    except Exception as exc:  # noqa: BLE001 - the user's code: report it in one line
        raise UsageError(
            f"--model {spec!r}: state_dict() failed on the meta device ({type(exc).__name__}: {exc})",
            hint="pass --model pkg.module:factory building the trained model",
        ) from None
    first: dict[int, str] = {}
    entries, buffers, frozen, shared = {}, [], [], {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        fqn = name(key)
        entries[fqn] = torch.empty(value.shape, dtype=value.dtype, device="meta")
        if not isinstance(value, nn.Parameter):
            buffers.append(fqn)
        elif id(value) in first:
            shared[fqn] = first[id(value)]
        else:
            first[id(value)] = fqn
            if not value.requires_grad:
                frozen.append((fqn, tuple(value.shape)))
    return ModelStates(
        path=path,
        module=entries,
        buffers=tuple(buffers),
        param_shapes=(),
        frozen_shapes=tuple(frozen),
        frozen_fragments={},
        shared=shared,
        job={},
        client={},
    )
