"""Write the benchmark's source: an FSDP2 DCP checkpoint of model + AdamW state.

Run under torchrun (CPU, gloo), e.g.:

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        scripts/bench_make_ckpt.py .bench/dcp-1gb --size-gb 1.0

The model is a stack of square Linear layers sized so that parameters plus the two
AdamW moments (all fp32) come to at least SIZE_GB (1 GB = 1e9 bytes). The checkpoint
is saved beside OUT_DIR and renamed into place only when complete, so a reused
OUT_DIR is never a half-written one.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

# fp32 parameter + exp_avg + exp_avg_sq
BYTES_PER_PARAM = 3 * 4
MAX_WIDTH = 2048
MIN_LAYERS = 8


def model_shape(size_gb: float, bytes_per_param: int = BYTES_PER_PARAM) -> tuple[int, int]:
    """Return (width, layers) of a Linear stack whose saved state is >= size_gb at bytes_per_param."""
    params = size_gb * 1e9 / bytes_per_param
    # Wide layers keep the per-tensor overhead small; small sizes still get several
    # layers so the checkpoint has more than a couple of tensors to shard.
    width = max(64, min(MAX_WIDTH, int(math.sqrt(params / MIN_LAYERS)) // 64 * 64))
    layers = max(1, math.ceil(params / (width * width + width)))
    return width, layers


def build(width: int, layers: int) -> nn.Sequential:
    """Return an FSDP2-sharded Linear stack (one fully_shard per layer, plus the root).

    On a CPU mesh: fully_shard's default mesh is on CUDA wherever CUDA is, and a machine
    with fewer GPUs than ranks then fails at its first rank without one.
    """
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def parse_args(description: str) -> argparse.Namespace:
    """Return OUT_DIR and --size-gb from the command line."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--size-gb", type=float, default=1.0)
    return parser.parse_args()


def save_in_place(out_dir: Path, save: Callable[[Path], None]) -> None:
    """Run ``save(tmp)`` on every rank beside out_dir, then rename tmp to out_dir (rank 0) and leave the job."""
    rank = dist.get_rank()
    tmp = out_dir.with_name(out_dir.name + ".partial")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    save(tmp)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
    # gloo can abort at teardown on a loaded machine unless ranks leave together.
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    """Train one step and save {"model", "optim"} with DCP into OUT_DIR."""
    args = parse_args(__doc__.splitlines()[0])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    width, layers = model_shape(args.size_gb)
    if dist.get_rank() == 0:
        print(f"bench_make_ckpt: {layers} x Linear({width}, {width}), fp32 + AdamW", flush=True)

    model = build(width, layers)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # One step on a tiny batch gives AdamW real exp_avg / exp_avg_sq / step state.
    model(torch.randn(2, width)).sum().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)

    msd, osd = get_state_dict(model, optim)
    save_in_place(
        args.out_dir, lambda tmp: dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp)
    )


if __name__ == "__main__":
    main()
