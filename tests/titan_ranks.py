"""Rank functions for the torchtitan tests: ``step-N`` directories saved and loaded at N ranks.

Two ways to make one: torchtitan's own ``CheckpointManager`` (when torchtitan is
installed), and the same tree built in-process exactly as torchtitan 0.3's code builds
it, for machines without torchtitan (see ``save_titan_like``).
"""

from __future__ import annotations

import pickle
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

_LOAD_SEED = 1234
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
STEPS = 2


def _full(model, optimizer) -> dict[str, Any]:
    """Return the full nested model and optimizer state (a collective; kept on rank 0)."""
    msd, osd = get_state_dict(model, optimizer, options=_FULL)
    return {"model": msd, "optim": osd}


# ---------------------------------------------------------------- built as torchtitan builds it


def save_titan_like(step_dir: str) -> dict[str, Any] | None:
    """Train the example under FSDP2 and ``dcp.save`` the tree torchtitan 0.3 saves; return the truth.

    As ``CheckpointManager._flattened_model_states_sd`` does: the model's state dict
    merged into the top level beside ``optimizer`` (flattened, the keys torchtitan's
    ``get_flat_optim_state_dict`` writes), ``lr_scheduler`` (``{"last_epoch"}``),
    ``dataloader`` (``ParallelAwareDataloader.state_dict``: this rank's pickled state
    under ``dp_rank_R`` and the data-parallel ``world_size``) and ``train_state``
    (the trainer's ``{"step", "ntokens_seen"}``); then one ``dcp.save``.
    """
    world_size, rank = dist.get_world_size(), dist.get_rank()
    model = example.shard_model(example.build_model(0), world_size)
    optimizer = example.build_optimizer(model)
    example.train(model, optimizer, steps=STEPS, seed=0)
    msd, osd = get_state_dict(model, optimizer, options=_FLAT)
    states: dict[str, Any] = {
        "train_state": {"step": STEPS, "ntokens_seen": 64 * STEPS},
        "optimizer": osd,
        "dataloader": {
            f"dp_rank_{rank}": pickle.dumps({"batches_yielded": STEPS, "rank": rank}),
            "world_size": world_size,
        },
        "lr_scheduler": {"last_epoch": STEPS},
    }
    states.update(msd)
    dcp.save(states, checkpoint_id=step_dir)
    truth = _full(model, optimizer)
    return {**truth, "lr_scheduler": STEPS, "train_state": STEPS} if rank == 0 else None


def load_titan_like(step_dir: str) -> dict[str, Any] | None:
    """Resume from ``step_dir`` as torchtitan's loader does, data loader excluded; return the state.

    ``_states_to_load`` with ``exclude_from_loading=["dataloader"]``: the model's FQNs at
    the top level, the flattened optimizer, scheduler and train state; ``dcp.load``, then
    the model and optimizer loaded from what it filled in.
    """
    model = example.shard_model(example.build_model(_LOAD_SEED), dist.get_world_size())
    optimizer = example.build_optimizer(model)
    msd, osd = get_state_dict(model, optimizer, options=_FLAT)
    states: dict[str, Any] = {
        "train_state": {"step": 0, "ntokens_seen": 0},
        "optimizer": osd,
        "lr_scheduler": {"last_epoch": 0},
    }
    states.update(msd)
    dcp.load(states, checkpoint_id=step_dir)
    set_state_dict(
        model,
        optimizer,
        model_state_dict={k: states[k] for k in msd},
        optim_state_dict=states["optimizer"],
        options=_FLAT,
    )
    out = _full(model, optimizer)
    extra = {
        "lr_scheduler": states["lr_scheduler"]["last_epoch"],
        "train_state": states["train_state"]["step"],
    }
    return {**out, **extra} if dist.get_rank() == 0 else None


# ---------------------------------------------------------------- torchtitan's own CheckpointManager


class _TrainState:
    """The trainer's ``train_state``: what ``Trainer.state_dict`` saves."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"]


class _Numbers(torch.utils.data.IterableDataset):
    """An endless stream of small integer tensors: a data loader with state to save."""

    def __iter__(self):
        i = 0
        while True:
            yield torch.tensor([i])
            i += 1


def _titan_job(seed: int, folder: str, exclude: list[str]):
    """Return (model, optimizers, lr_schedulers, dataloader, train_state, CheckpointManager)."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    world_size, rank = dist.get_world_size(), dist.get_rank()
    model = example.shard_model(example.build_model(seed), world_size)
    groups = [
        ParamGroupConfig(
            pattern=r"norm|bias",
            optimizer_name="AdamW",
            optimizer_kwargs={"lr": 3e-2, "weight_decay": 0.0, "betas": (0.9, 0.95)},
        ),
        ParamGroupConfig(
            pattern=r".*",
            optimizer_name="AdamW",
            optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1, "betas": (0.9, 0.95)},
        ),
    ]
    optimizers = OptimizersContainer(
        OptimizersContainer.Config(param_groups=groups, implementation="for-loop"),
        model_parts=[model],
    )
    schedulers = LRSchedulersContainer(optimizers, lambda step: 1.0)
    loader = ParallelAwareDataloader(_Numbers(), dp_rank=rank, dp_world_size=world_size)
    train_state = _TrainState()
    manager = CheckpointManager(
        CheckpointManager.Config(
            enable=True,
            folder="checkpoint",
            interval=1,
            keep_latest_k=0,
            exclude_from_loading=exclude,
        ),
        dataloader=loader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
        base_folder=folder,
    )
    return model, optimizers, schedulers, loader, train_state, manager


def save_with_torchtitan(folder: str) -> dict[str, Any] | None:
    """Train with torchtitan's containers and save ``step-STEPS`` with its CheckpointManager."""
    model, optimizers, schedulers, loader, train_state, manager = _titan_job(0, folder, [])
    batches = iter(loader)
    for _ in range(STEPS):
        next(batches)
        example.train(model, optimizers, steps=1, seed=train_state.step)
        schedulers.step()
        train_state.step += 1
        train_state.ntokens_seen += 64
    manager.save(curr_step=STEPS)
    manager.close()
    (inner,) = optimizers.optimizers
    truth = _full(model, inner)
    extra = {"lr_scheduler": schedulers.schedulers[0].last_epoch, "train_state": train_state.step}
    return {**truth, **extra} if dist.get_rank() == 0 else None


def load_with_torchtitan(folder: str) -> dict[str, Any] | None:
    """Resume with torchtitan's CheckpointManager at this world size, data loader excluded."""
    model, optimizers, schedulers, _, train_state, manager = _titan_job(
        _LOAD_SEED, folder, ["dataloader"]
    )
    assert manager.load(step=STEPS)
    manager.close()
    (inner,) = optimizers.optimizers
    out = _full(model, inner)
    extra = {"lr_scheduler": schedulers.schedulers[0].last_epoch, "train_state": train_state.step}
    return {**out, **extra} if dist.get_rank() == 0 else None
