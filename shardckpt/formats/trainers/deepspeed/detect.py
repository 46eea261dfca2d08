"""Whether a directory is a DeepSpeed checkpoint, judged by its names alone (nothing is loaded)."""

from __future__ import annotations

from pathlib import Path

from shardckpt.core.files import has_file
from shardckpt.formats.trainers.deepspeed.names import (
    LATEST,
    LATEST_UNIVERSAL,
    is_tag_dir,
    is_universal_dir,
)


def detect_dir(src: Path) -> str | None:
    """Return ``deepspeed`` or ``deepspeed-universal`` for a DeepSpeed directory, None for any other.

    A run directory is told by the ``latest`` (``latest_universal``) file DeepSpeed
    writes beside the tag directories (an HF Trainer ``checkpoint-N/`` is one, whatever
    else it holds); a tag directory by its model-states files, or by the ``zero/``
    directory of per-parameter files ``ds_to_universal`` writes. A ``latest`` that is not
    a regular file inside ``src`` (a link out of it, a FIFO) is refused, not taken for
    absent (``has_file``).
    """
    if has_file(src / LATEST, src):
        return "deepspeed"
    if has_file(src / LATEST_UNIVERSAL, src) or is_universal_dir(src):
        return "deepspeed-universal"
    if is_tag_dir(src):
        return "deepspeed"
    return None


def is_deepspeed_dir(src: Path) -> bool:
    """Return whether ``src`` is a DeepSpeed run or tag directory (``detect_dir``)."""
    return detect_dir(src) == "deepspeed"


def is_universal_checkpoint(src: Path) -> bool:
    """Return whether ``src`` is ``ds_to_universal``'s output (``detect_dir``)."""
    return detect_dir(src) == "deepspeed-universal"


def never(_src: Path) -> bool:
    """Return False: ``deepspeed-module`` is asked for with ``--from``, never detected."""
    return False
