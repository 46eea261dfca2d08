"""The big checkpoint of the streaming tests: its model, its values, and FSDP1 jobs that load it.

``Net`` is an embedding of ``VOCAB`` x ``DIM`` fp32 (``EMBED_MIB``, stored as one DCP
chunk: four times the tests' buffer, so it is read in slices of a chunk) and
``LAYERS`` ``Block``s of a ``DIM`` x ``DIM`` weight (16 MiB each): 1.25 GiB. ``value(fqn)`` is
the tensor the source holds under each name: cheap to make again (one random block,
shifted by a different constant per tensor and per row block), so the tests compare
with what was given to ``dcp.save`` without a second copy on disk. The jobs check
FSDP1 rank files at 2 ranks: loaded into real FSDP1 as a user resuming would, or as
torch unpickles their ShardedTensors.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

DIM = 2048
VOCAB = 8191 * 4  # uneven at 2 and 3 ranks
LAYERS = 64
MiB = 2**20


class Block(nn.Module):
    """A DIM -> DIM linear map: the unit FSDP1 wraps."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM, bias=False)


class Net(nn.Module):
    """The embedding, then ``LAYERS`` Blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.Sequential(*[Block() for _ in range(LAYERS)])


def build() -> Net:
    """Return a Net: the factory ``--model stream_jobs:build`` names."""
    return Net()


def names() -> list[str]:
    """Return the model's FQNs, in the model's order."""
    return ["embed.weight"] + [f"blocks.{i}.proj.weight" for i in range(LAYERS)]


@functools.cache
def _base() -> torch.Tensor:
    return torch.randn(DIM, DIM, generator=torch.Generator().manual_seed(0))


def value(fqn: str) -> torch.Tensor:
    """Return the tensor the source holds under model FQN ``fqn``."""
    base = _base()
    if fqn == "embed.weight":
        rows = [base + 1000.0 + j for j in range(-(-VOCAB // DIM))]
        return torch.cat(rows)[:VOCAB]
    return base + float(fqn.split(".")[1])


def source_bytes() -> int:
    return (VOCAB + LAYERS * DIM) * DIM * 4


def _materialize(module: nn.Module) -> None:
    """Give ``module``'s own meta parameters CPU storage filled with NaN, which no loaded value is."""
    module.to_empty(device="cpu", recurse=False)
    with torch.no_grad():
        for param in module.parameters(recurse=False):
            param.fill_(float("nan"))


def _fsdp1_model() -> FSDP:
    """Return Net under FSDP1 as ``--wrap stream_jobs:Block`` describes it, awaiting a load."""
    with torch.device("meta"):
        model = Net()
    return FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        device_id=torch.device("cpu"),
        param_init_fn=_materialize,
    )


def _mismatches(model: FSDP) -> list[str]:
    """Return the FQNs whose value FSDP1's full state dict does not hold exactly (rank 0)."""
    # rank0_only needs offload_to_cpu on CPU; every rank gathers the whole model instead.
    with FSDP.state_dict_type(
        model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False)
    ):
        full = model.state_dict()
    if dist.get_rank() != 0:
        return []
    bad = sorted(set(names()) ^ set(full))
    bad += [k for k in names() if k in full and not torch.equal(full[k], value(k))]
    return bad


def check_fsdp1_local(rank_dir: str) -> list[str]:
    """Load ``rank_{r}.pt`` into FSDP1 under LOCAL_STATE_DICT; return the FQNs it got wrong."""
    model = _fsdp1_model()
    state = torch.load(os.path.join(rank_dir, f"rank_{dist.get_rank()}.pt"), weights_only=False)
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        model.load_state_dict(state["model"])
    del state
    return _mismatches(model)


def check_sharded_tensors(rank_dir: str) -> list[str]:
    """Return the FQNs whose ShardedTensor in ``rank_{r}.pt`` is not FSDP1's shard of the value.

    FSDP1's SHARDED_STATE_DICT holds each parameter as a ShardedTensor of ``torch.chunk``
    pieces of dim 0, rank r holding piece r (``_create_chunk_sharded_tensor``).
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = torch.load(os.path.join(rank_dir, f"rank_{rank}.pt"), mmap=True, weights_only=False)
    model = model["model"]
    bad = sorted(set(names()) ^ set(model))
    for fqn in names():
        full = value(fqn)
        st = model.get(fqn)
        if not isinstance(st, ShardedTensor) or tuple(st.size()) != tuple(full.shape):
            bad.append(fqn)
            continue
        chunks = torch.chunk(full, world_size)
        start = sum(len(c) for c in chunks[:rank])
        shards = st.local_shards()
        if not (
            len(shards) == 1
            and list(shards[0].metadata.shard_offsets) == [start] + [0] * (full.dim() - 1)
            and torch.equal(shards[0].tensor, chunks[rank])
        ):
            bad.append(fqn)
    return bad
