"""Rank functions for the flattened-optimizer tests: FSDP2 saving and loading with torch's own
``get_state_dict``/``set_state_dict`` and ``flatten_optimizer_state_dict`` (importable by ranks)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from reference import example
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

# Loaders start from another seed, so a load that does nothing cannot pass.
_LOAD_SEED = 1234
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def save_flat(out_dir: str) -> dict[str, Any] | None:
    """Train the example under FSDP2, ``dcp.save`` it with a flattened optimizer; return the truth.

    The truth is the full nested state of the trained model and optimizer, on rank 0.
    """
    model = example.shard_model(example.build_model(0), dist.get_world_size())
    optimizer = example.build_optimizer(model)
    example.train(model, optimizer, steps=2, seed=0)
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    msd, osd = get_state_dict(model, optimizer, options=flat)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=out_dir)
    msd_full, osd_full = get_state_dict(model, optimizer, options=_FULL)
    return {"model": msd_full, "optim": osd_full} if dist.get_rank() == 0 else None


def load(dcp_dir: str, flat: bool) -> dict[str, Any] | None:
    """Resume from ``dcp_dir`` with ``dcp.load`` + ``set_state_dict``, the optimizer flattened or not.

    Returns the full nested state on rank 0.
    """
    model = example.shard_model(example.build_model(_LOAD_SEED), dist.get_world_size())
    optimizer = example.build_optimizer(model)
    options = StateDictOptions(flatten_optimizer_state_dict=flat)
    msd, osd = get_state_dict(model, optimizer, options=options)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=dcp_dir)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=options,
    )
    msd_full, osd_full = get_state_dict(model, optimizer, options=_FULL)
    return {"model": msd_full, "optim": osd_full} if dist.get_rank() == 0 else None
