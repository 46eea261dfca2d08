"""The collective hop: rows read on each rank become whole tensors or DTensor shards.

Both directions use DTensor, so the data movement is torch's own (all-gather with
padding for uneven rows over gloo or NCCL), never a hand-written exchange.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard

from shardckpt.tree import TensorMeta


def as_dtensor(local: torch.Tensor, meta: TensorMeta, runtime) -> DTensor:
    """Return the DTensor whose shard on this rank is ``local`` (``Shard(0)`` over all ranks)."""
    stride = torch.empty(meta.shape, device="meta").stride()
    return DTensor.from_local(local.to(runtime.device), runtime.mesh, [Shard(0)], run_check=False,
                              shape=torch.Size(meta.shape), stride=stride)


def assemble(local: torch.Tensor | None, meta: TensorMeta, runtime, sharded: bool) -> torch.Tensor | None:
    """Return the whole tensor on the coordinator (None elsewhere) from each rank's rows.

    ``sharded`` says whether every rank holds rows of it (a collective) or the
    coordinator alone read it whole (no communication).
    """
    if not runtime.distributed or not sharded:
        return local.cpu() if local is not None and runtime.coordinator else None
    whole = as_dtensor(local, meta, runtime).full_tensor()
    return whole.cpu() if runtime.coordinator else None
