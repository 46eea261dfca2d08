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

Every file the readers open passes the source gate (``core.files``): a regular file
inside SRC once symlinks are resolved (the tag directory too), one file per rank, no
two names for one file. ``latest`` is read only up to ``_MAX_POINTER`` bytes, and a tag
is shown in a message only as a short name.
"""

from __future__ import annotations

import itertools
import os
import re
from dataclasses import dataclass
from pathlib import Path

from shardckpt.core.errors import BadInputError
from shardckpt.core.files import (
    check_separate,
    has_file,
    open_source,
    os_error,
    source_entry,
    source_file,
)

LATEST = "latest"
LATEST_UNIVERSAL = "latest_universal"
UNIVERSAL_DIR = "zero"
UNIVERSAL_OPTIM = "optimizer_state.pt"
MODEL_FILE = re.compile(r"(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt")
OPTIM_FILE = re.compile(r"(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
# Pipeline-parallel layer files and expert (MoE) files: layouts this reader does not take.
OTHER_FILE = re.compile(r"layer_\d+.*_model_states\.pt|.*expert_\d+.*\.pt")
_MAX_TAG = 255  # NAME_MAX: a tag is the name of a directory
_MAX_POINTER = 1024  # read no more of a 'latest' file: DeepSpeed writes the tag alone


@dataclass(frozen=True)
class TagFiles:
    """The files of one save (a tag directory): model-states and optimizer files by data-parallel rank."""

    dir: Path
    model: dict[int, Path]
    """``mp_rank_00_model_states.pt`` under key 0 (ZeRO-1/2), or each rank's (ZeRO-3)."""
    optim: dict[int, Path]
    per_rank_model: bool
    """Whether there is a model-states file per rank (ZeRO-3)."""


def listing(path: Path) -> list[str]:
    """Return the names in directory ``path``, sorted; an OS error as one line naming it."""
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
    """Return whether ``path`` is a tag directory ``ds_to_universal`` wrote (``zero/optimizer_state.pt``).

    Something else under that name (a link out of ``path``, a FIFO) is refused, not
    taken for absent (``has_file``).
    """
    return (path / UNIVERSAL_DIR).is_dir() and has_file(
        path / UNIVERSAL_DIR / UNIVERSAL_OPTIM, path
    )


def shown(name: str) -> str:
    """Return a name read from a file as a message shows it: quoted, escaped, cut short when long."""
    return repr(name) if len(name) <= 64 else f"{name[:48]!r}… ({len(name)} characters)"


def read_pointer(file: Path, within: Path) -> str:
    """Return the tag the ``latest`` file ``file`` (of directory ``within``) names; refuse anything else.

    At most ``_MAX_POINTER`` bytes are read, and the file's content is never shown
    beyond a short tag: ``latest`` may be a link to any file, or huge.
    """
    source_file(file, within)
    try:
        with os.fdopen(open_source(file), "rb") as f:
            raw = f.read(_MAX_POINTER + 1)
    except OSError as exc:
        raise os_error(exc, file) from None
    if len(raw) > _MAX_POINTER:
        raise BadInputError(
            f"is over {_MAX_POINTER} bytes, where DeepSpeed writes the name of a tag directory",
            path=file,
            hint="pass the tag directory (global_stepN) itself",
        )
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise BadInputError(
            "does not hold a tag name (its bytes are not text)",
            path=file,
            hint="pass the tag directory (global_stepN) itself",
        ) from None
    if (
        not tag
        or "/" in tag
        or tag in (".", "..")
        or not tag.isprintable()
        or len(tag.encode()) > _MAX_TAG
    ):
        raise BadInputError(
            f"names {shown(tag)}, which is not a directory name",
            path=file,
            hint="pass the tag directory (global_stepN) itself",
        )
    return tag


def named_tag(run_dir: Path, pointer: str) -> Path | None:
    """Return the directory ``run_dir/<pointer file>`` names, None without that file; refuse a bad one."""
    file = run_dir / pointer
    if not has_file(file, run_dir):
        return None
    tag = read_pointer(file, run_dir)
    # The tag directory is SRC's own: a link to a save elsewhere is refused (source_entry).
    if not (os.path.lexists(run_dir / tag) and source_entry(run_dir / tag, run_dir)):
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
    """Refuse a set of per-rank files that is not ranks 0..W-1.

    ``world_size`` comes from a pickle (10**12 is a few bytes there): the first missing
    rank is at most the count of files, never found by walking every rank below it.
    """
    want = world_size if world_size is not None else max(found, default=-1) + 1
    missing = next(r for r in itertools.count() if r not in found)
    if missing < want:
        raise BadInputError(
            f"has no {what} file of data-parallel rank {missing} (found ranks "
            f"{', '.join(map(str, sorted(found))) or 'none'})",
            path=where,
            hint="copy every rank's files of the save",
        )
    extra = sorted(r for r in found if r >= want)
    if extra:
        raise BadInputError(
            f"holds '{found[extra[0]].name}', a file of rank {extra[0]}, but the save is of "
            f"{want} ranks",
            path=where,
            hint="the directory mixes two saves; keep only the files of one",
        )


def _one_per_rank(files: dict[int, Path], rank: int, path: Path, tag: Path) -> None:
    """Add ``path`` as ``rank``'s file; refuse a second file for it (``_rank_01_`` beside ``_rank_1_``)."""
    if rank in files:
        first, second = sorted((files[rank].name, path.name))
        raise BadInputError(
            f"holds two files of rank {rank}: '{first}' and '{second}'",
            path=tag,
            hint="the directory mixes two saves or copies of one file; keep only the "
            "files DeepSpeed wrote",
        )
    files[rank] = path


def tag_files(tag: Path, within: Path | None = None) -> TagFiles:
    """Return the model-states and optimizer files of a tag directory; refuse what it cannot read.

    Each file must be a regular file inside ``within`` (SRC; default: ``tag``) once
    symlinks are resolved, one per rank, and no two of them one file on disk.
    """
    model: dict[int, Path] = {}
    optim: dict[int, Path] = {}
    prefixes: set[str] = set()
    per_rank = None
    for name in listing(tag):
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
            _one_per_rank(model, int(m.group(1)) if rank_file else 0, tag / name, tag)
        elif (m := OPTIM_FILE.fullmatch(name)) is not None:
            _one_mp_rank(tag, name, m.group(3))
            prefixes.add(m.group(1) or "")
            _one_per_rank(optim, int(m.group(2)), tag / name, tag)
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
    for path in (*model.values(), *optim.values()):
        source_file(path, tag if within is None else within)
    check_separate(
        {
            **{("model-states", r): p for r, p in model.items()},
            **{("optimizer", r): p for r, p in optim.items()},
        },
        _whose,
    )
    return TagFiles(tag, model, optim, bool(per_rank))


def _whose(key: tuple[str, int]) -> str:
    what, rank = key
    return f"rank {rank}'s {what} file"


def check_ranks(files: TagFiles, world_size: int) -> None:
    """Refuse a save whose optimizer (and ZeRO-3 model-states) files are not those of ``world_size`` ranks."""
    _ranks(files.optim, "optimizer", files.dir, world_size)
    check_model_ranks(files, world_size)


def check_model_ranks(files: TagFiles, world_size: int) -> None:
    """Refuse ZeRO-3 model-states files that are not those of ``world_size`` ranks."""
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
