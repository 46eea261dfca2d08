"""FSDP2 jobs that save and load per-rank ``torch.save`` files, run by the dist tests on gloo ranks."""

from __future__ import annotations

import copy
import os
from typing import Any

import meshes
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from reference import example
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

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
    sd = torch.load(os.path.join(rank_dir, f"rank_{dist.get_rank()}.pt"), weights_only=True)
    model.load_state_dict(sd["model"])
    if id_keyed:
        optimizer.load_state_dict(sd["optim"])
    else:
        set_optimizer_state_dict(model, optimizer, sd["optim"])
    # The gathered 0-dim ``step`` tensors are the optimizer's own, which training bumps.
    loaded = copy.deepcopy(_full_state(model, optimizer))
    example.train(model, optimizer, 1, 7)
    return loaded


def save_2d_rank_files(out_dir: str, kind: str) -> dict[str, Any] | None:
    """Train on a 2x2 mesh (``hsdp`` or ``fsdp_tp``) and ``torch.save`` each rank's state.

    Returns the job's full state on rank 0.
    """
    mesh_names = {"hsdp": ("replicate", "shard"), "fsdp_tp": ("dp", "tp")}[kind]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=mesh_names)
    if kind == "hsdp":
        model, optimizer = meshes.train_example(mesh)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = meshes.Mlp()
        tp = {"fc_in": ColwiseParallel(), "fc_out": RowwiseParallel()}
        parallelize_module(model, mesh["tp"], tp)
        fully_shard(model, mesh=mesh["dp"])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(mesh["dp"].get_local_rank())
        model(torch.randn(3, 48, generator=gen)).pow(2).mean().backward()
        optimizer.step()
    state = {"model": model.state_dict(), "optim": get_state_dict(model, optimizer)[1]}
    torch.save(state, os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))
    return _full_state(model, optimizer)


def save_two_saves(out_dir: str) -> None:
    """Train 2 steps and save ``rank{r}.pt`` in ``step2/``, then 1 more and save in ``step3/``.

    Two saves of one job: the same files, shapes and layouts, other values.
    """
    model = example.shard_model(example.build_model(0), dist.get_world_size())
    optimizer = example.build_optimizer(model)
    for seed, (steps, sub) in enumerate(((2, "step2"), (1, "step3"))):
        example.train(model, optimizer, steps, seed)
        os.makedirs(os.path.join(out_dir, sub), exist_ok=True)
        state = {"model": model.state_dict(), "optim": get_state_dict(model, optimizer)[1]}
        torch.save(state, os.path.join(out_dir, sub, f"rank{dist.get_rank()}.pt"))


def save_replicated_dcp(out_dir: str) -> dict[str, Any] | None:
    """Train FSDP2 over a replicate x shard mesh of 2 x 1 and ``dcp.save`` it; return the full state.

    Every rank holds every parameter whole (its shard dimension has one rank), so DCP
    stores each tensor as one whole chunk, parameters and buffers alike, as Lightning's
    FSDP2 strategy does on such a mesh.
    """
    mesh = init_device_mesh(
        "cpu", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard")
    )
    model, optimizer = meshes.train_example(mesh)
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=out_dir)
    return _full_state(model, optimizer)


def build_model() -> torch.nn.Module:
    """Return the example TinyLM: the zero-argument factory ``--model`` names."""
    return example.build_model(0)


def save_wide_rank_files(out_dir: str) -> dict[str, Any] | None:
    """Save ``rank{r}.pt`` of an FSDP2 job whose shards span several ranged requests; return the full state on rank 0.

    Two linear layers (8 MiB and 4 MiB of weights) sharded over the job and one AdamW
    step, saved as ``save_rank_files`` saves (FQN-keyed optimizer state). A third layer
    of one output row leaves the last rank's shards of it empty, and an empty buffer is
    a storage of no bytes (torch.load on the meta device reads no record for it).
    """
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 2048), torch.nn.Linear(2048, 512), torch.nn.Linear(512, 1)
    )
    model.register_buffer("empty", torch.empty(0, 4))
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 1024)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optim": get_state_dict(model, optimizer)[1]}
    torch.save(state, os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))
    return _full_state(model, optimizer)
