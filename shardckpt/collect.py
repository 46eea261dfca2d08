"""The collective hop: rows read on each rank become whole tensors on rank 0.

Rows are the ones DTensor's ``Shard(0)`` gives each rank, so rank r's rows start at
``r * ceil(n / N)`` and every non-final rank holds exactly ``ceil(n / N)`` rows. A whole
tensor is therefore one gather (``Runtime.gather_into``) into row blocks of a padded buffer on rank 0:
each rank's rows land in place, nothing is copied twice, and no other rank receives
anything.
"""

from __future__ import annotations

import torch

from shardckpt.tree import TensorMeta


def assemble(
    local: torch.Tensor | None, meta: TensorMeta, runtime, sharded: bool
) -> torch.Tensor | None:
    """Return the whole tensor on the coordinator (None elsewhere) from each rank's rows.

    ``sharded`` says whether every rank holds rows of it (a collective) or the
    coordinator alone read it whole (no communication).
    """
    if not runtime.distributed or not sharded:
        return local.cpu() if local is not None and runtime.coordinator else None
    rows, world = meta.shape[0], runtime.world_size
    block = -(-rows // world)  # ceil: the rows of every rank but the last non-empty one
    padded = torch.zeros((block,) + tuple(meta.shape[1:]), dtype=meta.dtype, device=runtime.device)
    padded[: local.shape[0]].copy_(local)
    if not runtime.coordinator:
        runtime.gather_into(padded, None)
        return None
    whole = torch.empty(
        (block * world,) + tuple(meta.shape[1:]), dtype=meta.dtype, device=runtime.device
    )
    runtime.gather_into(padded, list(whole.chunk(world)) if block else [padded] * world)
    return whole[:rows].cpu()
