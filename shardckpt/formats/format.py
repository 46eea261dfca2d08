"""``Format``: everything about one on-disk format that code outside ``formats/`` may ask.

Each family package (``formats/dcp/``, ``formats/hf/``, ...) describes its formats in its
``__init__.py`` and the registry (``formats/__init__.py``) collects them. A description
names its reader, writer and the other code it needs by import path (``Ref``), loaded on
first use: the registry is read by the CLI to build its options and help, which must not
import torch (a second or more), so no family's ``__init__`` imports its modules.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class Ref:
    """A callable named by ``"package.module:attribute"``, imported when first called or read."""

    __slots__ = ("path", "_target")

    def __init__(self, path: str):
        module, sep, attribute = path.partition(":")
        if not sep or not module or not attribute:
            raise ValueError(f"a Ref names 'package.module:attribute', not {path!r}")
        self.path = path
        self._target: Any = None

    @property
    def target(self) -> Any:
        """Return the object named, importing its module the first time."""
        if self._target is None:
            module, _, attribute = self.path.partition(":")
            self._target = getattr(importlib.import_module(module), attribute)
        return self._target

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.target(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Ref({self.path!r})"


def never(_index: object) -> bool:
    """Return False: the format does not say which tensors every rank held whole."""
    return False


def always(_index: object) -> bool:
    """Return True: every tensor's chunks say how it was held (per-rank formats)."""
    return True


def as_is(tree: dict, _src: str) -> dict:
    """Return ``tree``: the format holds all of a selected tree."""
    return tree


def no_notes(_tree: dict, _world_size: int) -> list[str]:
    """Return no notes: nothing in a tree of this format needs saying at a world size."""
    return []


@dataclass(frozen=True, kw_only=True)
class Format:
    """One on-disk format: its layout, how it is named, read, written and detected."""

    name: str
    layout: str
    """``full``, ``sharded`` or ``local`` (SPEC's layouts)."""
    title: str
    """How messages name it ("a DCP checkpoint")."""
    reader: Callable[..., Any]
    """The ``formats.base.Reader`` class, called as ``reader(path, trust_pickle, ...)``."""
    writer: Callable[..., Any]
    """The ``formats.base.Writer`` class, called as ``writer(staging_path, plan)``."""
    directory: bool
    """Whether the format is a directory of files (staged as one) rather than one file."""
    detect: Callable[..., bool]
    """Whether a path is in this format, judged from what is on disk (see the registry's
    order: a format that contains another, Lightning's DCP, is asked first)."""
    suffixes: tuple[str, ...] = ()
    """File suffixes that name this format: a DST called so must be written in it."""
    default_for: str | None = None
    """The layout this format is written in when ``--format`` is not given."""
    min_world_size: int = 1
    """The fewest target ranks the format can describe (FSDP1 on one rank runs NO_SHARD)."""
    needs_model: bool = False
    """Whether reading and writing it needs ``--model``/``--wrap`` (FSDP1 flat parameters)."""
    max_shard_size: bool = False
    """Whether ``--max-shard-size`` applies."""
    keys_as_str: bool = False
    """Whether it hands every mapping key back as ``str`` (DCP): compare trees in that form."""
    tells_whole: Callable[..., bool] = never
    """Whether a source in this format says which tensors every rank held whole."""
    dst_tree: Callable[..., dict] = as_is
    """The part of a selected tree this format holds (``hf``: model tensors only)."""
    src_local: bool = False
    """Whether a source can be read from files spread over the ranks' own disks (``sight``)."""
    carries_files: bool = False
    """Whether it copies the files a source carries unread (``Index.parts``) into DST."""
    components: Callable[..., list] | None = None
    """A trainer's checkpoint: the parts of its tree (model, optimizer, ...) ``inspect`` lists."""
    reads_with_model: bool = False
    """Whether its reader takes ``--model``/``--wrap`` when given, without needing them
    (veRL's FSDP1 optimizer state is read by FQN only with them)."""
    keeps_layout: bool = False
    """A trainer's own directory: converted to its layout without ``--format``, a source in
    this format is written in it again (``default_format``), not as a bare DCP."""
    refuses_part: Callable[..., None] | None = None
    """Raises when a file passed as SRC on its own is one part of a checkpoint directory
    of this format (a DeepSpeed rank's file), naming the directory to pass."""
    notes: Callable[..., list[str]] = no_notes
    """What to tell the user about DST's tree at a world size (parts the trainer will not
    take as they are there), said once on stderr."""
    written: bool = True
    """Whether shardckpt writes it (``--format``), or reads it only (its writer refuses)."""
    commit_last: tuple[str, ...] = ()
    """The files a reader takes as the checkpoint's commit (DCP's ``.metadata``): on object
    storage, where nothing is renamed into place, they are uploaded after every other."""
    model_root: bool = False
    """One file a model loads (``torch``, ``safetensors``): with ``--only model``, DST's
    root is the ``model`` subtree, what ``model.load_state_dict`` takes."""
