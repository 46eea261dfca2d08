"""What a veRL ``FSDPCheckpointManager`` directory is called and holds, by name (no tensor read).

veRL 0.9 saves, for each rank r of a job of N ranks (``save_checkpoint``):

- ``model_world_size_{N}_rank_{r}.pt``: ``model.state_dict()`` (FSDP2: DTensors; FSDP1
  under ``SHARDED_STATE_DICT``: ShardedTensors);
- ``optim_world_size_{N}_rank_{r}.pt``: ``optimizer.state_dict()`` as torch keys it, by
  param ID (FSDP2: DTensor state; FSDP1: each rank's slice of each flat parameter);
- ``extra_state_world_size_{N}_rank_{r}.pt``: ``{"lr_scheduler", "rng"}``, the RNG state
  holding numpy objects;

and on rank 0 ``fsdp_config.json`` (``{"FSDP_version", "world_size"}``) and
``huggingface/`` (the model's config, tokenizer; the weights too when asked for).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from shardckpt.codecs.pickle_scan import DamagedPickle, NotTorchFile, scan_torch_file
from shardckpt.core.errors import BadInputError
from shardckpt.core.files import os_error, source_file
from shardckpt.formats.ranks.sharded_tensor_load import SHARDED_TENSOR

MODEL = "model"
OPTIM = "optim"
EXTRA = "extra_state"
PARTS = (MODEL, OPTIM, EXTRA)
CONFIG_FILE = "fsdp_config.json"
HF_DIR = "huggingface"

_NAME = re.compile(
    r"(?P<part>model|optim|extra_state)_world_size_(?P<ws>\d+)_rank_(?P<rank>\d+)\.pt"
)


def file_name(part: str, world_size: int, rank: int) -> str:
    """Return the name veRL gives rank ``rank``'s file of ``part`` in a job of ``world_size``."""
    return f"{part}_world_size_{world_size}_rank_{rank}.pt"


def pattern(part: str, world_size: int) -> str:
    """Return the glob that names every rank's file of ``part`` (how ``inspect`` lists them)."""
    return file_name(part, world_size, 0).replace("_rank_0.pt", "_rank_*.pt")


def parse(name: str) -> tuple[str, int, int] | None:
    """Return ``(part, world size, rank)`` of a veRL per-rank file name, or None for another name."""
    m = _NAME.fullmatch(name)
    return (m["part"], int(m["ws"]), int(m["rank"])) if m else None


def format_of(version: int) -> str:
    """Return the format name of a veRL directory saved by FSDP ``version``."""
    return "verl-fsdp1" if version == 1 else "verl"


def detect(src: Path) -> str | None:
    """Return ``verl`` or ``verl-fsdp1`` for a directory of veRL's per-rank model files, else None."""
    try:
        found = [p for e in src.iterdir() if (p := parse(e.name)) is not None and p[0] == MODEL]
    except OSError:
        return None
    if not found:
        return None
    config = read_config(src) if (src / CONFIG_FILE).exists() else None
    if config is not None:
        return format_of(config.version)
    return format_of(fsdp_version(src / file_name(MODEL, found[0][1], 0)))


@dataclass(frozen=True)
class FsdpConfig:
    """``fsdp_config.json``: the FSDP version and world size of the job that saved."""

    version: int
    world_size: int


def read_config(src: Path) -> FsdpConfig | None:
    """Return SRC's ``fsdp_config.json`` (plain JSON, checked), or None when it has none."""
    path = src / CONFIG_FILE
    if not path.exists():
        return None
    try:
        with open(source_file(path), encoding="utf-8") as f:
            raw = json.load(f)
    except OSError as exc:
        raise os_error(exc, path) from None
    except ValueError as exc:
        raise BadInputError(
            f"is not JSON ({exc})", path=path, hint="re-copy it from where veRL saved it"
        ) from None
    version, world_size = (
        raw.get(k) if isinstance(raw, dict) else None for k in ("FSDP_version", "world_size")
    )
    if version not in (1, 2) or not isinstance(world_size, int) or world_size < 1:
        raise BadInputError(
            'does not hold {"FSDP_version": 1 or 2, "world_size": N}',
            path=path,
            hint="re-copy it from where veRL saved it",
        )
    return FsdpConfig(version, world_size)


def write_config(dst: Path, config: FsdpConfig) -> None:
    """Write ``fsdp_config.json`` as veRL's manager writes it."""
    text = json.dumps({"FSDP_version": config.version, "world_size": config.world_size}, indent=4)
    dst.joinpath(CONFIG_FILE).write_text(text, encoding="utf-8")


def fsdp_version(model_file: Path) -> int:
    """Return the FSDP version a model file was saved by: ShardedTensors are FSDP1's (read as opcodes)."""
    try:
        found = scan_torch_file(source_file(model_file))
    except (DamagedPickle, NotTorchFile) as exc:
        raise BadInputError(
            f"is not a readable torch.save file ({exc})",
            path=model_file,
            hint="re-copy it from where veRL saved it",
        ) from None
    return 1 if SHARDED_TENSOR in found.globals else 2


def is_verl(src: Path) -> bool:
    """Return whether ``src`` is a veRL directory saved under FSDP2."""
    return detect(src) == "verl"


def is_verl_fsdp1(src: Path) -> bool:
    """Return whether ``src`` is a veRL directory saved under FSDP1."""
    return detect(src) == "verl-fsdp1"
