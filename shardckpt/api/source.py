"""Opening a source for any command: the option rules before and after its format is known."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING

from shardckpt.api import applies
from shardckpt.core.sight import Sight
from shardckpt.formats import open_reader
from shardckpt.formats.base import Reader

if TYPE_CHECKING:  # --model builds a module: torch
    from shardckpt.formats.fsdp1.flat_layout import FlatModel


def open_checked(
    src: str | os.PathLike,
    src_format: str | None,
    rules: tuple[applies.Rule, ...],
    choice: applies.Choice,
    *,
    trust_pickle: bool,
    flat_model: FlatModel | None = None,
    sight: Sight | None = None,
) -> Reader:
    """Return a reader for ``src``; refuse an option that does not apply, before and after opening.

    The rules about the source can only be judged once its format is known: those about
    the output and the options alone are judged first, so a bad option is named before
    any of SRC is read.
    """
    applies.check(rules, choice)
    reader = open_reader(src, src_format, trust_pickle, flat_model, sight)
    applies.check(rules, replace(choice, src_format=reader.format))
    return reader
