"""FSDP2 jobs that save and load per-rank ``torch.save`` files, run by the dist tests on gloo ranks."""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
import torch.distributed as dist
from reference import example
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_optimizer_state_dict,
)

# As in reference.py: a load that silently does nothing must not match the reference.
_LOAD_SEED = 1234


def _full_state(model, optimizer) -> dict[str, Any] | None:
    """Return the job's full ``{"model", "optim"}`` state on rank 0 (a collective)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, optimizer, options=options)
    return {"model": msd, "optim": osd} if dist.get_rank() == 0 else None


def save_rank_files(out_dir: str, id_keyed: bool = False) -> dict[str, Any] | None:
    """Train the example with FSDP2 and ``torch.save`` this rank's state as ``rank{r}.pt``.

    The model part is ``model.state_dict()``; the optimizer part is FQN-keyed
    (``get_state_dict``) or, with ``id_keyed``, ``optimizer.state_dict()``. Returns the
    full state on rank 0.
    """
    model = example.shard_model(example.build_model(0), dist.get_world_size())
    optimizer = example.build_optimizer(model)
    example.train(model, optimizer, 2, 0)
    osd = optimizer.state_dict() if id_keyed else get_state_dict(model, optimizer)[1]
    state = {"model": model.state_dict(), "optim": osd}
    torch.save(state, os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))
    return _full_state(model, optimizer)


def load_rank_files(rank_dir: str, id_keyed: bool = False) -> dict[str, Any] | None:
    """Resume FSDP2 from this rank's file as a user would; return the full state on rank 0.

    ``torch.load(weights_only=True)``, ``model.load_state_dict`` and, for the optimizer,
    ``set_optimizer_state_dict`` (FQN keys) or ``optimizer.load_state_dict`` (param IDs).
    One optimizer step after the load proves the loaded DTensors work in training.
    """
    model = example.shard_model(example.build_model(_LOAD_SEED), dist.get_world_size())
    optimizer = example.build_optimizer(model)
    sd = torch.load(os.path.join(rank_dir, f"rank{dist.get_rank()}.pt"), weights_only=True)
    model.load_state_dict(sd["model"])
    if id_keyed:
        optimizer.load_state_dict(sd["optim"])
    else:
        set_optimizer_state_dict(model, optimizer, sd["optim"])
    # The gathered 0-dim ``step`` tensors are the optimizer's own, which training bumps.
    loaded = copy.deepcopy(_full_state(model, optimizer))
    example.train(model, optimizer, 1, 7)
    return loaded
