"""Write the DCP goldens of torch releases this suite does not run in leg 1.

    python tests/goldens/dcp/make.py   # with the torch release whose save to write

``torch-VERSION/``: ``torch.distributed.checkpoint.save`` of a small state (one float32
matrix, a bfloat16 vector, an int step), no process group. torch 2.15 pickles each
tensor's ``TensorProperties`` with six fields (its strides) where 2.13 pickles five:
``inspect`` and ``verify`` read that ``.metadata`` without torch too
(tests/unit/test_torch_free_commands.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp


def state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"w": torch.randn(4, 3, generator=g), "norm": torch.ones(3, dtype=torch.bfloat16)},
        "step": 3,
    }


if __name__ == "__main__":
    out = Path(__file__).parent / f"torch-{torch.__version__.split('+')[0]}"
    dcp.save(state(), checkpoint_id=out, no_dist=True)
    print(f"wrote {out}")
