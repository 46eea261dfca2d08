"""The files ``Accelerator.save_state`` writes, by name: its directory told without torch (``accelerate.py`` reads it)."""

from __future__ import annotations

import re
from pathlib import Path

MODEL_DIR = re.compile(r"pytorch_model_fsdp_(\d+)")
OPTIM_DIR = re.compile(r"optimizer_(\d+)")
MODEL_FILE = re.compile(
    r"(?:pytorch_model_fsdp|pytorch_model|model)(?:_(\d+))?\.(?:bin|safetensors)"
)
RNG_FILE = re.compile(r"random_states_(\d+)\.pkl")


def looks_like(src: Path) -> bool:
    """Return whether directory ``src`` is one ``save_state`` wrote (judged by its names)."""
    try:
        names = {p.name for p in src.iterdir()}
    except OSError:
        return False
    return any(RNG_FILE.fullmatch(n) or MODEL_DIR.fullmatch(n) for n in names) or (
        any(OPTIM_DIR.fullmatch(n) for n in names)
        and any(MODEL_FILE.fullmatch(n) or MODEL_DIR.fullmatch(n) for n in names)
    )
