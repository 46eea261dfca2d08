"""The DeepSpeed goldens (``tests/goldens/deepspeed``, written by ``make.py`` with the real
library) and what DeepSpeed itself read from them, for the tests to compare with."""

from __future__ import annotations

import math
from pathlib import Path

import torch

GOLDENS = Path(__file__).resolve().parent / "goldens" / "deepspeed"
# DeepSpeed's own saves at M of --format deepspeed conversions it loaded (written.py).
WRITTEN = GOLDENS / "written"

# name: (ZeRO stage, ranks); every case make.py writes.
CASES = {
    "z1-bf16": (1, 2),
    "z1-fp32": (1, 2),
    "z2-bf16": (2, 2),
    "z2-fp32": (2, 2),
    "z3-bf16": (3, 2),
    "z3-fp32": (3, 2),
    "z2-fp16": (2, 2),
    "z2-bf16-rr3": (2, 3),
    "z3-fp32-sub3": (3, 3),
    "z1-bf16-fp32acc": (1, 2),
}
FROZEN = ("frozen.weight", "frozen.bias")
TIED = {"head.weight": "embed.weight"}
MOMENTS = ("exp_avg", "exp_avg_sq")


def run_dir(name: str, root: Path = GOLDENS) -> Path:
    """Return the run directory (with ``latest``) of a case."""
    return root / name


def tag_dir(name: str) -> Path:
    """Return the tag directory (``global_step3``) of a case."""
    return GOLDENS / name / "global_step3"


def universal_dir(name: str, root: Path = GOLDENS) -> Path:
    """Return the ``ds_to_universal`` output of a case."""
    return root / f"{name}-universal"


def zero_to_fp32(name: str, root: Path = GOLDENS) -> dict | None:
    """Return what the run's ``zero_to_fp32.py`` wrote (None where it refused the run)."""
    path = root / f"{name}.ref" / "zero_to_fp32.bin"
    return torch.load(path, weights_only=True) if path.exists() else None


def gathered(name: str, root: Path = GOLDENS) -> dict:
    """Return what the job gathered with DeepSpeed's API when it saved (see make.py)."""
    return torch.load(root / f"{name}.ref" / "gathered.pt", weights_only=True)


def universal_states(
    name: str, shapes: dict | None = None, root: Path = GOLDENS
) -> dict[str, dict[str, torch.Tensor]]:
    """Return ``{fqn: {state: tensor}}`` from ds_to_universal's per-parameter files, read with torch.

    ZeRO-1/2's files hold ``{"param": tensor}``, ZeRO-3's the bare flat tensor: each is
    shaped here as its parameter (``shapes``; default: the job's gathered fp32 masters').
    """
    if shapes is None:
        shapes = {k: v.shape for k, v in gathered(name, root)["fp32"].items()}
    out: dict = {}
    zero = universal_dir(name, root) / "global_step3" / "zero"
    for fqn, shape in shapes.items():
        for file in sorted((zero / fqn).glob("*.pt")):
            obj = torch.load(file, weights_only=True)
            t = obj["param"] if isinstance(obj, dict) else obj
            want = () if file.stem == "step" else shape
            assert t.numel() == math.prod(want), (file, t.shape)
            out.setdefault(fqn, {})[file.stem] = t.reshape(want)
    return out


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Return whether two tensors have one dtype, one shape and the same bytes."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    flat_a, flat_b = a.detach().contiguous().reshape(-1), b.detach().contiguous().reshape(-1)
    return torch.equal(flat_a.view(torch.uint8), flat_b.view(torch.uint8))
