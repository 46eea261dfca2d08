"""Training jobs on 2-D meshes (HSDP, FSDP+TP) that the dist tests run on 4 gloo ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from reference import example
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class Mlp(nn.Module):
    """A residual MLP: hidden 6 splits 3/3 over tensor parallelism, then 2/1 under FSDP."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(48)
        self.fc_in = nn.Linear(48, 6)
        self.fc_out = nn.Linear(6, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return x plus the MLP of its normalised value."""
        return x + self.fc_out(F.relu(self.fc_in(self.norm(x))))


def train_example(mesh) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Return the example model ``fully_shard``-ed (each block, then the whole) over ``mesh``, trained 2 steps."""
    model = example.build_model(0)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = example.build_optimizer(model)
    example.train(model, optimizer, 2, 0)
    return model, optimizer


def _save(model: nn.Module, optimizer: torch.optim.Optimizer, out_dir: str, ref_path: str) -> None:
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=out_dir)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd_full, osd_full = get_state_dict(model, optimizer, options=options)
    if dist.get_rank() == 0:
        torch.save({"model": msd_full, "optim": osd_full}, ref_path)


def train_hsdp(out_dir: str, ref_path: str) -> None:
    """Train the example model with HSDP (replicate 2 x shard 2) and save DCP + full reference."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model, optimizer = train_example(mesh)
    _save(model, optimizer, out_dir, ref_path)


def train_fsdp_tp(out_dir: str, ref_path: str) -> None:
    """Train an MLP with FSDP (dp 2) over tensor parallelism (tp 2) and save DCP + full reference."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Mlp()
    parallelize_module(model, mesh["tp"], {"fc_in": ColwiseParallel(), "fc_out": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # Tensor-parallel ranks must see the same batch; data-parallel ranks differ.
    gen = torch.Generator().manual_seed(mesh["dp"].get_local_rank())
    for _ in range(2):
        model(torch.randn(3, 48, generator=gen)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    _save(model, optimizer, out_dir, ref_path)
