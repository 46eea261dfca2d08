"""FSDP2 jobs whose state holds empty mappings: plain SGD keeps no state, so ``state`` is ``{}``."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from reference import example
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def empties() -> dict[str, Any]:
    """Return what a training loop keeps beside model and optimizer, still empty."""
    return {"trainer": {"callbacks": {}}, "extra": {}}


def save_full_state(ref_path: str) -> None:
    """Train the example model under FSDP2 with SGD for a step; rank 0 torch.saves the full state."""
    model = example.shard_model(example.build_model(0), dist.get_world_size())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    example.train(model, optimizer, 1, 0)
    msd, osd = get_state_dict(model, optimizer, options=FULL)
    if dist.get_rank() == 0:
        torch.save({"model": msd, "optim": osd, **empties()}, ref_path)


def resume(dcp_dir: str) -> dict[str, Any] | None:
    """Resume as training does, with the empty mappings in the state dict; return it full on rank 0."""
    model = example.shard_model(example.build_model(1234), dist.get_world_size())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd, **empties()}
    dcp.load(state, checkpoint_id=dcp_dir)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    msd_full, osd_full = get_state_dict(model, optimizer, options=FULL)
    kept = {k: state[k] for k in empties()}
    return {"model": msd_full, "optim": osd_full, **kept} if dist.get_rank() == 0 else None
