"""Rank functions for the veRL tests: load a veRL directory as veRL's FSDP2 manager loads it."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from verl_models import qwen2


def load_like_verl(ckpt: str) -> dict | None:
    """Load ``ckpt`` into the goldens' Qwen2 under FSDP2 at this world size; return full state on rank 0.

    What ``FSDPCheckpointManager.load_checkpoint`` does under FSDP2, without veRL: each
    rank ``torch.load``s its own model and optimizer file and hands them to
    ``model.load_state_dict`` and ``optimizer.load_state_dict``.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)
    model = qwen2()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01)
    for part, target in (("model", model), ("optim", optimizer)):
        path = f"{ckpt}/{part}_world_size_{world_size}_rank_{rank}.pt"
        target.load_state_dict(torch.load(path, weights_only=False))
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, optimizer, options=options)
    return {"model": msd, "optim": osd} if rank == 0 else None
