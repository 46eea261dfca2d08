"""Rank functions for the veRL tests: load a veRL directory as veRL's manager loads it."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import StateDictType, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer
from verl_models import qwen2


def _wrapped(kind: str, world_size: int):
    """Return the goldens' Qwen2 wrapped as veRL wraps it: FSDP2 per layer and root, or FSDP1 units."""
    torch.manual_seed(1234)
    model = qwen2()
    if kind == "fsdp1":
        policy = ModuleWrapPolicy({Qwen2DecoderLayer})
        return FSDP(model, auto_wrap_policy=policy, device_id=torch.device("cpu"))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def load_like_verl(ckpt: str, kind: str) -> dict | None:
    """Load ``ckpt`` into a ``kind`` job at this world size; return its full state on rank 0.

    What ``FSDPCheckpointManager.load_checkpoint`` does, without veRL: each rank
    ``torch.load``s its own model and optimizer file and hands them to
    ``model.load_state_dict`` and ``optimizer.load_state_dict`` (FSDP1: under
    ``SHARDED_STATE_DICT``).
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = _wrapped(kind, world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01)
    if kind == "fsdp1":
        FSDP.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT)
    for part, target in (("model", model), ("optim", optimizer)):
        path = f"{ckpt}/{part}_world_size_{world_size}_rank_{rank}.pt"
        target.load_state_dict(torch.load(path, weights_only=False))
    # FSDP1 offloads a full state dict to CPU only from a GPU; on CPU it is there already.
    options = StateDictOptions(full_state_dict=True, cpu_offload=kind == "fsdp2")
    msd, osd = get_state_dict(model, optimizer, options=options)
    return {"model": msd, "optim": osd} if rank == 0 else None
