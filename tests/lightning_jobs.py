"""Lightning Fabric jobs the dist tests run on every pooled gloo rank (importable by spawned ranks).

Fabric runs inside the harness's ranks as it runs under torchrun: the process group is
already joined (Fabric then skips its own init) and torchelastic's environment
variables tell it the rank and world size. They are set for one job and taken back
after it, since the pooled ranks serve later tests.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn


class Net(nn.Module):
    """Two uneven linear layers (7x3, 5x7), so shards at 2 and 3 ranks have remainders."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(3, 7)
        self.fc2 = nn.Linear(7, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


@contextmanager
def _torchelastic_env() -> Iterator[None]:
    """Set what torchrun would tell Fabric about this rank, and restore the environment after."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    saved = dict(os.environ)
    os.environ.update(
        TORCHELASTIC_RUN_ID="shardckpt-tests",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
    )
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _fsdp_strategy():
    """Return Fabric's ``FSDPStrategy`` (FSDP1) saving sharded checkpoints, usable on CPU."""
    from lightning.fabric.strategies import FSDPStrategy

    # Fabric refuses FSDPStrategy itself without a GPU (its check is on the exact type);
    # FSDP1 runs on CPU over gloo, and a subclass changes nothing else.
    class CpuFSDPStrategy(FSDPStrategy):
        pass

    return CpuFSDPStrategy(state_dict_type="sharded")


def _fully_shard(model: nn.Module, mesh) -> nn.Module:
    """The ``parallelize_fn`` of ``ModelParallelStrategy``: FSDP2 over the data-parallel mesh."""
    from torch.distributed.fsdp import fully_shard

    dp = mesh["data_parallel"]
    for layer in (model.fc1, model.fc2):
        fully_shard(layer, mesh=dp)
    return fully_shard(model, mesh=dp)


def _model_parallel_strategy():
    """Return Fabric's ``ModelParallelStrategy`` (FSDP2 here) saving DCP + meta.pt."""
    from lightning.fabric.strategies import ModelParallelStrategy

    return ModelParallelStrategy(
        _fully_shard, data_parallel_size=dist.get_world_size(), tensor_parallel_size=1
    )


STRATEGIES = {"fsdp": _fsdp_strategy, "model_parallel": _model_parallel_strategy}


def _fabric(strategy: str):
    """Return a launched Fabric on CPU at this job's world size with ``strategy``."""
    from lightning.fabric import Fabric

    fabric = Fabric(
        accelerator="cpu", devices=dist.get_world_size(), strategy=STRATEGIES[strategy]()
    )
    fabric.launch()
    return fabric


def _setup(fabric, strategy: str):
    """Return the model and Adam set up by ``fabric`` from the same seed on every rank.

    For ``fsdp`` the model is wrapped in FSDP1 here, as a user may do before
    ``setup_module`` (Fabric then keeps the wrapping): Fabric's own wrapping passes no
    ``device_id``, and FSDP1 on a machine without an accelerator needs ``device_id=cpu``.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Net()
    if strategy == "fsdp":
        model = FullyShardedDataParallel(
            model,
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
            device_id=torch.device("cpu"),
            use_orig_params=True,
        )
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.1))
    return model, optimizer


def _step(fabric, model, optimizer, seed: int) -> None:
    """Take one training step on a batch that depends on ``seed`` and this rank."""
    generator = torch.Generator().manual_seed(seed * 100 + fabric.global_rank)
    x = torch.randn(4, 3, generator=generator)
    loss = model(x).square().mean()
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()


def _full_state(model, optimizer, strategy: str) -> dict:
    """Return the model and optimizer state gathered whole on every rank, keyed by FQN."""
    if strategy == "fsdp":
        return _fsdp1_full_state(model, optimizer)
    from torch.distributed.tensor import DTensor

    def whole(tree):
        if isinstance(tree, dict):
            return {k: whole(v) for k, v in tree.items()}
        if isinstance(tree, list):
            return [whole(v) for v in tree]
        if isinstance(tree, DTensor):
            return tree.full_tensor()
        # A plain tensor (Adam's step) is the optimizer's own, which the next step changes.
        return tree.detach().clone() if isinstance(tree, torch.Tensor) else tree

    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model._forward_module, optimizer.optimizer)
    return {"model": whole(model_state), "optimizer": whole(optim_state)}


def _fsdp1_full_state(model, optimizer) -> dict:
    """Return FSDP1's full state dicts of model and optimizer, on every rank."""
    from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel, StateDictType
    from torch.distributed.fsdp.api import FullOptimStateDictConfig

    fsdp = model._forward_module
    with FullyShardedDataParallel.state_dict_type(
        fsdp,
        StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(rank0_only=False),
        FullOptimStateDictConfig(rank0_only=False),
    ):
        return {
            "model": {k: v.detach().clone() for k, v in fsdp.state_dict().items()},
            "optimizer": FullyShardedDataParallel.optim_state_dict(fsdp, optimizer.optimizer),
        }


def train_and_save(path: str, steps: int, strategy: str) -> dict | None:
    """Train ``steps`` steps, ``fabric.save`` a sharded checkpoint to ``path``; rank 0 returns the state."""
    with _torchelastic_env():
        fabric = _fabric(strategy)
        model, optimizer = _setup(fabric, strategy)
        for step in range(steps):
            _step(fabric, model, optimizer, step)
        fabric.save(path, {"model": model, "optimizer": optimizer, "step": steps, "note": "lit"})
        state = _full_state(model, optimizer, strategy)
    return state if dist.get_rank() == 0 else None


def load_and_step(path: str, strategy: str) -> dict | None:
    """``fabric.load`` ``path`` at this world size, take one step; rank 0 returns the states."""
    with _torchelastic_env():
        fabric = _fabric(strategy)
        model, optimizer = _setup(fabric, strategy)
        state = {"model": model, "optimizer": optimizer, "step": 0, "note": ""}
        rest = fabric.load(path, state)
        loaded = _full_state(model, optimizer, strategy)
        _step(fabric, model, optimizer, 7)
        stepped = _full_state(model, optimizer, strategy)
    if dist.get_rank() != 0:
        return None
    return {
        "loaded": loaded,
        "stepped": stepped,
        "extras": {"step": state["step"], "note": state["note"]},
        "rest": rest,
    }
