"""The files of a DeepSpeed checkpoint: which directory is the save, and which file is which rank's.

``engine.save_checkpoint(run_dir)`` writes ``run_dir/latest`` (the tag, ``global_stepN``
by default) and ``run_dir/<tag>/``, which holds, for data-parallel rank r of a job with
one model-parallel rank (``mp_rank_00``):

- ``mp_rank_00_model_states.pt`` (ZeRO-1/2: the module's state dict and the layout of the
  flat partitions), or ``zero_pp_rank_{r}_mp_rank_00_model_states.pt`` (ZeRO-3: one per
  rank, parameters as placeholders);
- ``[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt``: rank r's partition of the fp32
  master weights and of the optimizer state (``bf16_`` when bf16 was enabled).

``ds_to_universal`` writes ``<out>/<tag>/zero/<fqn>/fp32.pt`` (and ``exp_avg.pt``, ...),
``zero/optimizer_state.pt`` and a copy of the model-states files, and names the tag in
``<out>/latest_universal``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from shardckpt.core.errors import BadInputError
from shardckpt.core.files import os_error

LATEST = "latest"
LATEST_UNIVERSAL = "latest_universal"
UNIVERSAL_DIR = "zero"
UNIVERSAL_OPTIM = "optimizer_state.pt"
MODEL_FILE = re.compile(r"(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt")
OPTIM_FILE = re.compile(r"(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
# Pipeline-parallel layer files and expert (MoE) files: layouts this reader does not take.
OTHER_FILE = re.compile(r"layer_\d+.*_model_states\.pt|.*expert_\d+.*\.pt")


@dataclass(frozen=True)
class TagFiles:
    """The files of one save (a tag directory): model-states and optimizer files by data-parallel rank."""

    dir: Path
    model: dict[int, Path]
    """``mp_rank_00_model_states.pt`` under key 0 (ZeRO-1/2), or each rank's (ZeRO-3)."""
    optim: dict[int, Path]
    per_rank_model: bool
    """Whether there is a model-states file per rank (ZeRO-3)."""


def _listing(path: Path) -> list[str]:
    try:
        return sorted(p.name for p in path.iterdir())
    except OSError as exc:
        raise os_error(exc, path) from None


def is_deepspeed_file(name: str) -> bool:
    """Return whether a file name is one DeepSpeed gives the files of a ZeRO checkpoint."""
    return bool(MODEL_FILE.fullmatch(name) or OPTIM_FILE.fullmatch(name))


def is_tag_dir(path: Path) -> bool:
    """Return whether ``path`` holds a DeepSpeed model-states file (a ``global_stepN`` directory)."""
    try:
        return any(MODEL_FILE.fullmatch(p.name) for p in path.iterdir())
    except OSError:
        return False


def is_universal_dir(path: Path) -> bool:
    """Return whether ``path`` is a tag directory ``ds_to_universal`` wrote (``zero/optimizer_state.pt``)."""
    return (path / UNIVERSAL_DIR / UNIVERSAL_OPTIM).is_file()


def named_tag(run_dir: Path, pointer: str) -> Path | None:
    """Return the directory ``run_dir/<pointer file>`` names, None without that file; refuse a bad one."""
    file = run_dir / pointer
    if not file.is_file():
        return None
    try:
        tag = file.read_text(errors="replace").strip()
    except OSError as exc:
        raise os_error(exc, file) from None
    if not tag or "/" in tag or tag in (".", ".."):
        raise BadInputError(
            f"names {tag!r}, which is not a directory name",
            path=file,
            hint="pass the tag directory (global_stepN) itself",
        )
    if not (run_dir / tag).is_dir():
        raise BadInputError(
            f"names the tag {tag!r}, but '{run_dir / tag}' is not a directory",
            path=file,
            hint="the save did not finish or the directory was moved; pass a tag directory "
            "(global_stepN) that is there",
        )
    return run_dir / tag


def tag_dir(src: Path) -> Path:
    """Return the tag directory a source names: SRC itself, or the one SRC's ``latest`` names."""
    return named_tag(src, LATEST) or src


def universal_tag_dir(src: Path) -> Path:
    """Return the universal tag directory: SRC itself, or the one SRC's ``latest_universal`` names."""
    return named_tag(src, LATEST_UNIVERSAL) or src


def _ranks(found: dict[int, Path], what: str, where: Path, world_size: int | None) -> None:
    """Refuse a set of per-rank files that is not ranks 0..W-1."""
    want = set(range(world_size if world_size is not None else max(found, default=-1) + 1))
    missing = sorted(want - set(found))
    if missing:
        raise BadInputError(
            f"has no {what} file of data-parallel rank {missing[0]} (found ranks "
            f"{', '.join(map(str, sorted(found))) or 'none'})",
            path=where,
            hint="copy every rank's files of the save",
        )
    extra = sorted(set(found) - want)
    if extra:
        raise BadInputError(
            f"holds '{found[extra[0]].name}', a file of rank {extra[0]}, but the save is of "
            f"{len(want)} ranks",
            path=where,
            hint="the directory mixes two saves; keep only the files of one",
        )


def tag_files(tag: Path) -> TagFiles:
    """Return the model-states and optimizer files of a tag directory; refuse what it cannot read."""
    model: dict[int, Path] = {}
    optim: dict[int, Path] = {}
    prefixes: set[str] = set()
    per_rank = None
    for name in _listing(tag):
        if OTHER_FILE.fullmatch(name):
            raise BadInputError(
                f"holds '{name}', a pipeline-parallel or expert (MoE) file",
                path=tag,
                hint="shardckpt reads data-parallel ZeRO checkpoints (mp_rank_00, no pipeline "
                "or expert files)",
            )
        if (m := MODEL_FILE.fullmatch(name)) is not None:
            _one_mp_rank(tag, name, m.group(2))
            rank_file = m.group(1) is not None
            if per_rank is not None and per_rank != rank_file:
                raise BadInputError(
                    "holds both ZeRO-1/2 (mp_rank_00_model_states.pt) and ZeRO-3 "
                    "(zero_pp_rank_R_mp_rank_00_model_states.pt) model-states files",
                    path=tag,
                    hint="the directory mixes two saves; keep only the files of one",
                )
            per_rank = rank_file
            model[int(m.group(1)) if rank_file else 0] = tag / name
        elif (m := OPTIM_FILE.fullmatch(name)) is not None:
            _one_mp_rank(tag, name, m.group(3))
            prefixes.add(m.group(1) or "")
            optim[int(m.group(2))] = tag / name
    if not model:
        raise BadInputError(
            "holds no DeepSpeed model-states file (mp_rank_00_model_states.pt)",
            path=tag,
            hint="pass the run directory (with 'latest') or a global_stepN directory",
        )
    if len(prefixes) > 1:
        raise BadInputError(
            "holds optimizer files of bf16 and of other runs (bf16_zero_pp_rank_* beside "
            "zero_pp_rank_*)",
            path=tag,
            hint="the directory mixes two saves; keep only the files of one",
        )
    if per_rank:
        _ranks(model, "model-states", tag, None)
    return TagFiles(tag, model, optim, bool(per_rank))


def check_ranks(files: TagFiles, world_size: int) -> None:
    """Refuse a save whose optimizer (and ZeRO-3 model-states) files are not those of ``world_size`` ranks."""
    _ranks(files.optim, "optimizer", files.dir, world_size)
    if files.per_rank_model:
        _ranks(files.model, "model-states", files.dir, world_size)


def _one_mp_rank(tag: Path, name: str, mp_rank: str) -> None:
    if int(mp_rank) != 0:
        raise BadInputError(
            f"holds '{name}', a file of model-parallel rank {int(mp_rank)}",
            path=tag,
            hint="shardckpt reads data-parallel ZeRO checkpoints (mp_rank_00 only), not "
            "tensor- or pipeline-parallel ones",
        )
