"""The registry: every format's description (``Format``), collected from its family, and detection.

Each family package (``dcp/``, ``torch_save/``, ``hf/``, ``fsdp1/``, ``fsdp2/``,
``trainers/``) describes its formats in its ``__init__``; this module only lists them,
in the order messages name them, and in the order detection asks them. Adding a format
touches its family's folder and these two lists. Nothing here imports torch.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from shardckpt.core.errors import BadInputError, UnsafePickleError, UsageError
from shardckpt.core.files import read_head, source_stat
from shardckpt.core.words import closest
from shardckpt.formats import dcp, fsdp1, fsdp2, hf, torch_save, trainers
from shardckpt.formats.dcp.read_once import metadata_read_once
from shardckpt.formats.format import Format
from shardckpt.formats.not_a_checkpoint import not_a_checkpoint
from shardckpt.state.choices import LAYOUTS

if TYPE_CHECKING:
    from shardckpt.core.sight import Sight
    from shardckpt.formats.base import Reader
    from shardckpt.formats.fsdp1.flat_layout import FlatModel

# The order messages list them in.
FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        dcp.DCP,
        dcp.DCP_SAFETENSORS,
        dcp.HF_STORAGE,
        trainers.TORCH_CHECKPOINTING,
        torch_save.TORCH,
        hf.SAFETENSORS,
        hf.HF,
        trainers.LIGHTNING,
        trainers.MEGATRON,
        fsdp2.FSDP2_RANKS,
        fsdp1.FSDP1_SHARDED,
        fsdp1.FSDP1_LOCAL,
        trainers.ACCELERATE,
        trainers.TORCHTITAN,
        trainers.VERL,
        trainers.VERL_FSDP1,
        trainers.DEEPSPEED,
        trainers.DEEPSPEED_MODULE,
        trainers.DEEPSPEED_UNIVERSAL,
    )
}

# The order detection asks them in: DeepSpeed's first (an HF Trainer ``checkpoint-N/``
# holds other formats' files beside its ``latest``); a format that is another with more beside it
# (Megatron's, Lightning's, torchtitan's DCP, or DCP of safetensors blobs) before that one, FSDP1's rank files before the
# rank directory any per-rank format is.
DETECTION: tuple[Format, ...] = (
    trainers.DEEPSPEED,
    trainers.DEEPSPEED_UNIVERSAL,
    trainers.MEGATRON,
    trainers.LIGHTNING,
    dcp.DCP_SAFETENSORS,
    trainers.TORCHTITAN,
    dcp.DCP,
    trainers.TORCH_CHECKPOINTING,
    trainers.ACCELERATE,  # its save_state may hold a model.safetensors: before hf
    hf.HF,
    dcp.HF_STORAGE,
    trainers.VERL,
    trainers.VERL_FSDP1,
    fsdp1.FSDP1_LOCAL,
    fsdp1.FSDP1_SHARDED,
    fsdp2.FSDP2_RANKS,
    torch_save.TORCH,
    hf.SAFETENSORS,
    trainers.DEEPSPEED_MODULE,  # never detected: asked for with --from
)
assert sorted(f.name for f in DETECTION) == sorted(FORMATS), "every format is detected"

FILE_SUFFIXES = {suffix: f.name for f in FORMATS.values() for suffix in f.suffixes}
SUPPORTED_READ = ", ".join(FORMATS)


def format_named(name: str) -> Format:
    """Return the format called ``name``; refuse an unknown name, with the one it is likely a typo of."""
    if name in FORMATS:
        return FORMATS[name]
    guess = closest(name, (*FORMATS, *LAYOUTS))
    if guess in LAYOUTS:
        # `--format sharded` (or `shraded`): a layout given where a format is asked for.
        formats = ", ".join(f.name for f in FORMATS.values() if f.layout == guess)
        hint = f"{guess} is a layout, --to {guess}; its formats are {formats}"
    elif guess is not None:
        hint = f"did you mean {guess}?"
    else:
        hint = f"use one of {SUPPORTED_READ}"
    raise UsageError(f"unknown format {name!r}", hint=hint)


def default_format(layout: str, dst: str | os.PathLike, src_format: str | None = None) -> str:
    """Return the format SPEC writes a layout in when no ``--format`` is given (by DST's suffix for full).

    A trainer's directory (``Format.keeps_layout``, ``src_format``) converted to its own
    layout is written in its own format: what its trainer loads.
    """
    if src_format is not None and FORMATS[src_format].keeps_layout:
        if FORMATS[src_format].layout == layout:
            return src_format
    named = FILE_SUFFIXES.get(Path(dst).suffix.lower())
    if named is not None and FORMATS[named].layout == layout:
        return named
    return next(f.name for f in FORMATS.values() if f.default_for == layout)


def detect(src: Path) -> str:
    """Return the format of ``src`` judged from what is on disk."""
    directory = stat.S_ISDIR(source_stat(src).st_mode)
    if not directory:
        for form in FORMATS.values():
            if form.refuses_part is not None:
                form.refuses_part(src)
    if not directory and not read_head(src, 1):
        raise BadInputError(
            "is empty", path=src, hint="the file was not written completely; re-create it"
        )
    for form in DETECTION:
        if form.directory == directory and form.detect(src):
            return form.name
    if not directory:
        raise not_a_checkpoint(src)
    if any(p.suffix == ".distcp" for p in src.iterdir()):
        raise BadInputError(
            f"has *.distcp files but no '{dcp.METADATA_FILE}'",
            path=src,
            hint="the DCP save did not finish; use a checkpoint whose save completed",
        )
    raise BadInputError(
        "is a directory with no checkpoint in it",
        path=src,
        hint=f"pass a DCP directory (with '{dcp.METADATA_FILE}'), a directory of per-rank "
        "files (rank_0.pt, ...) or a checkpoint file",
    )


def checkpoint_files(path: Path) -> tuple[str, frozenset[str]] | None:
    """Return how messages name the checkpoint ``path`` reads as, and the files it is made of.

    None when no format is detected. Read as a source is, metadata only and no pickle
    trusted; a format detected but not read raises its reader's error. A one-file
    checkpoint whose pickle names objects (only ``--trust-pickle`` loads it) still counts:
    it is a checkpoint, made of itself. This is what ``--overwrite`` asks of DST.
    """
    with metadata_read_once():
        try:
            form = format_named(detect(path))
        except BadInputError:
            return None
        try:
            reader = open_reader(path, form.name)
            reader.index()
        except UnsafePickleError:
            if form.directory:
                raise
            return form.title, frozenset({""})
        return form.title, reader.members()


def open_reader(
    src: str | os.PathLike,
    fmt: str | None = None,
    trust_pickle: bool = False,
    flat_model: FlatModel | None = None,
    sight: Sight | None = None,
) -> Reader:
    """Return a reader for ``src``, detecting its format unless ``fmt`` names one.

    ``flat_model`` (``--model``/``--wrap``) lets ``fsdp1-local`` name what its flat
    parameters hold; other formats do not need it. ``sight`` (who sees which of SRC's
    files, under ``torchrun``) makes a reader read only files its rank sees; where not
    every rank sees every file, only a format that can (``Format.src_local``) is read.
    """
    with metadata_read_once():
        return _open_reader(Path(src), fmt, trust_pickle, flat_model, sight)


def _open_reader(
    path: Path, fmt: str | None, trust_pickle: bool, flat_model: FlatModel | None, sight
) -> Reader:
    """``open_reader`` itself, where each DCP ``.metadata`` is read once."""
    if sight is None:
        form = format_named(fmt or detect(path))
    else:
        # Detected where the most of SRC is seen (the coordinator's node, which holds
        # DCP's .metadata, in a job that saved to node-local disks).
        form = format_named(
            fmt or sight.shared(sight.files_of(sight.most_seeing()), lambda: detect(path))
        )
        if sight.complete:
            sight = None
        elif not form.src_local:
            raise BadInputError(
                f"not every rank sees every file of this {form.title} checkpoint, and such a "
                "source is read from one filesystem every rank sees",
                path=path,
                hint="copy SRC where every rank sees it (only DCP sources are read from "
                "node-local disks)",
            )
    if form.needs_model or form.reads_with_model:
        return form.reader(path, trust_pickle, flat_model)  # type: ignore[call-arg]
    if sight is not None:
        return form.reader(path, trust_pickle, sight)  # type: ignore[call-arg]
    return form.reader(path, trust_pickle)


__all__ = [
    "FILE_SUFFIXES",
    "FORMATS",
    "Format",
    "SUPPORTED_READ",
    "checkpoint_files",
    "default_format",
    "detect",
    "format_named",
    "checkpoint_files",
    "open_reader",
]
