"""Functions run on gloo ranks for the torch_checkpointing tests: a tiny FSDP2 model and
AdamW saved and loaded by the library itself (importable by spawned ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor


class Tiny(torch.nn.Module):
    """Uneven shapes (7x3, 5x7), a bias of 5 and a buffer, so shards have remainders."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(3, 7, bias=False)
        self.out = torch.nn.Linear(7, 5)
        self.register_buffer("scale", torch.arange(4, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.fc(x))) * self.scale.sum()


def trained(steps: int = 2) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Return the tiny model under FSDP2 on the world group and its AdamW, after ``steps`` steps."""
    torch.manual_seed(0)
    model = Tiny()
    fully_shard(model.fc)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    for _ in range(steps):
        model(torch.randn(4, 3, generator=g)).sum().backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def _gather_on_cpu(self, data, process_group=None) -> dict:
    """The library's all-gather of pickled metadata, over CPU tensors (gloo) instead of CUDA."""
    gathered = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(gathered, data, group=process_group)
    return dict(enumerate(gathered))


def manager(safetensors_model: bool):
    """Return a CheckpointManager that saves synchronously and reshards on load.

    torch_checkpointing 0.1.1 all-gathers the ranks' pickled sharding metadata through
    CUDA tensors (``DefaultMetadataManager._all_gather_pickled_data`` hard-codes
    ``device="cuda"``); on gloo ranks without GPUs that one transport goes through
    ``all_gather_object`` instead: the same objects arrive, and every byte saved and
    loaded is the library's own.
    """
    from torch_checkpointing import CheckpointManager, ItemSpec
    from torch_checkpointing.metadata_manager import DefaultMetadataManager
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    DefaultMetadataManager._all_gather_pickled_data = _gather_on_cpu
    from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization
    from torch_checkpointing.config import SyncCheckpointSaverConfig
    from torch_checkpointing.default_resharder import DefaultResharder

    layout = (
        LayoutInfo("model_{rank}.safetensors", SafetensorsSerialization())
        if safetensors_model
        else None
    )
    items = {
        "model": ItemSpec(resharder=DefaultResharder(), layout=layout),
        "optim": ItemSpec(resharder=DefaultResharder()),
    }
    # O_DIRECT writes fail on tmpfs and overlay filesystems (EINVAL at close).
    storage = LocalFileSystemStorageConfig(use_direct_io=False)
    return CheckpointManager(
        CheckpointManager.Config(
            items=items, save=SyncCheckpointSaverConfig(), storage_config=storage
        )
    )


def local(tree):
    """Return ``tree`` with every DTensor replaced by its full tensor (a collective)."""
    if isinstance(tree, dict):
        return {k: local(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [local(v) for v in tree]
    if isinstance(tree, DTensor):
        return tree.full_tensor()
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    return tree


def save(path: str, safetensors_model: bool = True) -> dict:
    """Train, save with the library, and return the full model and optimizer state."""
    model, optim = trained()
    msd = get_model_state_dict(model)
    osd = get_optimizer_state_dict(model, optim)
    m = manager(safetensors_model)
    m.save(path, {"model": msd, "optim": osd, "step": 2})
    m.close()
    return {"model": local(msd), "optim": local(osd)}


def load(path: str, with_step: bool = True) -> dict:
    """Load ``path`` with the library into a fresh FSDP2 job at this world size, then take a step.

    Returns the loaded full model and optimizer state, the loaded ``step`` (when
    ``with_step``: an item saved without a resharder is read from this rank's own file,
    which a save at another world size may not have), and the model state after one
    more training step.
    """
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model, optim = trained(steps=1)  # optimizer state exists to load into
    into = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optim),
    }
    if with_step:
        into["step"] = 0
    m = manager(safetensors_model=True)
    loaded = m.load(path, into=into)
    m.close()
    set_model_state_dict(model, loaded["model"])
    set_optimizer_state_dict(model, optim, loaded["optim"])
    state = {
        "model": local(get_model_state_dict(model)),
        "optim": local(get_optimizer_state_dict(model, optim)),
        "step": loaded.get("step"),
    }
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    model(torch.randn(4, 3, generator=g)).sum().backward()
    optim.step()
    state["after_step"] = local(get_model_state_dict(model))
    return state
