"""Rank functions for the FSDP1 tests: real FSDP1 on gloo ranks saves and loads per-rank files."""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
from reference import example
from torch.distributed.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictType,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

# Loads build the model from another seed, so a load that does nothing cannot match.
_LOAD_SEED = 1234


def wrap(model: torch.nn.Module, use_orig_params: bool) -> FSDP:
    """Return ``model`` under FSDP1 as the tests train it: each Block a unit, then the root."""
    return FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy({example.Block}),
        use_orig_params=use_orig_params,
        device_id=torch.device("cpu"),
    )


def optimizer_for(model: FSDP, use_orig_params: bool) -> torch.optim.Optimizer:
    """Return AdamW: the example's two groups with original params, else one group of flat params."""
    if use_orig_params:
        return example.build_optimizer(model)
    return torch.optim.AdamW(model.parameters(), betas=(0.9, 0.95))


def full_state(model: FSDP, optimizer: torch.optim.Optimizer) -> dict:
    """Return FSDP1's own FULL_STATE_DICT of model and optimizer (every rank gets it)."""
    FSDP.set_state_dict_type(
        model,
        StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(rank0_only=False),
        FullOptimStateDictConfig(rank0_only=False),
    )
    return {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optimizer)}


def save(out_dir: str, use_orig_params: bool) -> dict | None:
    """Train under FSDP1 and save LOCAL and SHARDED per-rank files; return the full state on rank 0.

    ``local_optim/`` is LOCAL model state beside the optimizer's own ``state_dict()``, as a
    training loop might save it: each rank's state of its own flat shard.
    """
    rank = dist.get_rank()
    model = wrap(example.build_model(0), use_orig_params)
    optimizer = optimizer_for(model, use_orig_params)
    example.train(model, optimizer, steps=2, seed=0)
    for sub in ("local", "local_optim", "sharded"):
        os.makedirs(os.path.join(out_dir, sub), exist_ok=True)
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        local = model.state_dict()
        torch.save({"model": local}, os.path.join(out_dir, "local", f"rank_{rank}.pt"))
        state = {"model": local, "optim": optimizer.state_dict()}
        torch.save(state, os.path.join(out_dir, "local_optim", f"rank_{rank}.pt"))
    FSDP.set_state_dict_type(
        model,
        StateDictType.SHARDED_STATE_DICT,
        ShardedStateDictConfig(),
        ShardedOptimStateDictConfig(),
    )
    state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optimizer)}
    torch.save(state, os.path.join(out_dir, "sharded", f"rank_{rank}.pt"))
    full = full_state(model, optimizer)
    return full if rank == 0 else None


def save_two_saves(out_dir: str) -> None:
    """Train 2 steps and save, then 1 more and save again: ``sharded{2,3}/`` and ``local{2,3}/``.

    Two saves of one job: SHARDED_STATE_DICT model and optimizer state, and LOCAL model
    state beside the loop's own step counter, as a training loop might save them.
    """
    rank = dist.get_rank()
    model = wrap(example.build_model(0), False)
    optimizer = optimizer_for(model, False)
    for seed, steps in enumerate((2, 1)):
        example.train(model, optimizer, steps=steps, seed=seed)
        done = 2 + seed
        for sub in (f"sharded{done}", f"local{done}"):
            os.makedirs(os.path.join(out_dir, sub), exist_ok=True)
        with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
            state = {"model": model.state_dict(), "steps": done}
            torch.save(state, os.path.join(out_dir, f"local{done}", f"rank_{rank}.pt"))
        with FSDP.state_dict_type(
            model,
            StateDictType.SHARDED_STATE_DICT,
            ShardedStateDictConfig(),
            ShardedOptimStateDictConfig(),
        ):
            state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optimizer)}
            torch.save(state, os.path.join(out_dir, f"sharded{done}", f"rank_{rank}.pt"))


def load_local(src_dir: str, use_orig_params: bool) -> dict | None:
    """Load ``rank_{r}.pt`` into FSDP1 under LOCAL_STATE_DICT; return FULL_STATE_DICT's model on rank 0."""
    model = wrap(example.build_model(_LOAD_SEED), use_orig_params)
    state = torch.load(os.path.join(src_dir, f"rank_{dist.get_rank()}.pt"), weights_only=False)
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        # With use_orig_params FSDP1 loads its own LOCAL files only non-strictly: the
        # flat parameters it saved are then "unexpected" (they are loaded all the same).
        result = model.load_state_dict(state["model"], strict=not use_orig_params)
    flat = [k for k in state["model"] if k.endswith("_flat_param")]
    assert not result.missing_keys and result.unexpected_keys == (flat if use_orig_params else [])
    optimizer = optimizer_for(model, use_orig_params)
    full = copy.deepcopy(full_state(model, optimizer)["model"])
    # One step proves the loaded flat parameters train.
    example.train(model, optimizer, steps=1, seed=7)
    return full if dist.get_rank() == 0 else None


def load_sharded(src_dir: str) -> dict | None:
    """Load ``rank_{r}.pt`` (model and optimizer) into FSDP1 under SHARDED_STATE_DICT; return the full state."""
    model = wrap(example.build_model(_LOAD_SEED), False)
    optimizer = optimizer_for(model, False)
    state = torch.load(os.path.join(src_dir, f"rank_{dist.get_rank()}.pt"), weights_only=False)
    FSDP.set_state_dict_type(
        model,
        StateDictType.SHARDED_STATE_DICT,
        ShardedStateDictConfig(),
        ShardedOptimStateDictConfig(),
    )
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer, state["optim"]))
    full = copy.deepcopy(full_state(model, optimizer))
    # One step proves the loaded parameters and optimizer state train.
    example.train(model, optimizer, steps=1, seed=7)
    return full if dist.get_rank() == 0 else None


# For --model fsdp1_jobs:build_model --wrap fsdp1_jobs:Block (importable on every rank).
Block = example.Block


def build_model() -> torch.nn.Module:
    """Return the example TinyLM: the zero-argument factory ``--model`` needs."""
    return example.build_model(0)
