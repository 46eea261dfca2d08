"""Write the scale benchmark's source: a DCP checkpoint of many small tensors (model + AdamW).

    python scripts/bench_make_scale.py OUT_DIR [--tensors 2000]

One process, as ``dcp.save`` without a process group writes it. The model is a stack of
``Linear(1, rows)`` layers whose row counts cycle through a few sizes of 1024 rows or
more (so every tensor splits over up to 1024 ranks, and the split differs from one
shape to the next); AdamW's state after one step gives each parameter ``exp_avg``,
``exp_avg_sq`` and a 0-dim ``step``: 8 tensors per layer. The data is small (about 3 KiB
a tensor), so a conversion of it is bound by planning and framing, not by I/O.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

TENSORS_PER_LAYER = 8
"""weight, bias, and AdamW's exp_avg, exp_avg_sq and step of each."""
ROWS = (1024, 1031, 1100, 1536, 2000)


def model(tensors: int = 2000) -> nn.Module:
    """Return the Linear stack of a source of about ``tensors`` tensors (``--model bench_make_scale:model``)."""
    layers = max(1, tensors // TENSORS_PER_LAYER)
    return nn.Sequential(*(nn.Linear(1, ROWS[i % len(ROWS)]) for i in range(layers)))


def build(tensors: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Return a Linear stack with about ``tensors`` tensors of state, and AdamW after one step."""
    torch.manual_seed(0)
    model_ = model(tensors)
    optim = torch.optim.AdamW(model_.parameters(), lr=1e-3)
    x = torch.randn(2, 1)
    sum(layer(x).sum() for layer in model_).backward()
    optim.step()
    return model_, optim


def main() -> None:
    """Save {"model", "optim"} with DCP into OUT_DIR (written beside it, renamed when complete)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--tensors", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    built, optim = build(args.tensors)
    msd, osd = get_state_dict(built, optim)
    tmp = args.out_dir.with_name(args.out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp, no_dist=True)
    shutil.rmtree(args.out_dir, ignore_errors=True)
    os.replace(tmp, args.out_dir)


if __name__ == "__main__":
    main()
