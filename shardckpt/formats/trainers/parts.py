"""Sources and outputs made of several checkpoints: one tree, one top-level key per part.

A trainer's checkpoint directory keeps the model in one checkpoint, the optimizer in
another and small files beside them. ``PartsReader`` joins readers of formats that
already exist under top-level keys of one tree and sends each ``read`` to the reader
that holds the tensor; ``PartsWriter`` writes each part with an existing writer into its
own subdirectory of one staged DST, and copies the files carried unread. A trainer's
module (``formats/accelerate.py``) only says which file is which part.

Tensor keys of the joined tree are ``"<part key>::<the part reader's key>"``, so that
two parts may use the same key without clashing in a plan.
"""

from __future__ import annotations

import os
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType

import torch

from shardckpt.core.copies import copy_entry
from shardckpt.core.errors import BadInputError
from shardckpt.core.files import os_error, source_entry, source_tree, writing
from shardckpt.formats.base import (
    Frame,
    Index,
    Reader,
    Rows,
    SourcePart,
    StoredItem,
    Writer,
    rekeyed,
)
from shardckpt.formats.ranks.target_ranks import merge_frames
from shardckpt.state.regions import Record
from shardckpt.state.tree import TensorMeta, map_leaves, tensor_leaves

SEP = "::"


@dataclass(frozen=True)
class Part:
    """One checkpoint of a source made of several, read by a reader of its own format."""

    key: str
    """The top-level key it is under in the joined tree."""
    file: str
    """Relative to SRC."""
    reader: Reader
    nested: str | None = None
    """The one top-level key its own tree holds it under (lifted out), or None."""


class PartsReader(Reader):
    """Reads a source made of several checkpoints as one tree (``open_parts`` says which is which)."""

    def __init__(self, src, trust_pickle: bool = False):
        super().__init__(src, trust_pickle)
        self.parts, self.carried = self.open_parts()
        for carried in self.carried:
            # A carried directory is walked now: a bad entry deep inside it is refused
            # before any data moves, not when DST is nearly written.
            path = self.src / carried.file
            if source_entry(path, self.src):
                source_tree(path, self.src)
        self._by_key: dict[str, Part] = {}
        for part in self.parts:
            if (first := self._by_key.setdefault(part.key, part)) is not part:
                raise BadInputError(
                    f"both {first.file!r} and {part.file!r} hold its {part.key!r}",
                    path=self.src,
                    hint="keep the one the job saved last (move the other away), or convert "
                    "each on its own",
                )
        self._index: Index | None = None

    @abstractmethod
    def open_parts(self) -> tuple[list[Part], list[SourcePart]]:
        """Return the parts read, and the files carried unread (each with what it holds)."""

    def entries(self) -> list[tuple[Path, bool]]:
        """Return SRC's entries by name, each with whether it is a directory (else a regular file).

        Each passes the source-file gate: a link out of SRC, a dangling link, a FIFO or a
        device is refused here, before any part is opened.
        """
        try:
            names = sorted(os.listdir(self.src))
        except OSError as exc:
            raise os_error(exc, self.src) from None
        return [(self.src / name, source_entry(self.src / name, self.src)) for name in names]

    def world_size(self, indexes: dict[str, Index]) -> int | None:
        """Return the world size of the job that saved SRC, from its parts' indexes."""
        known = [i.world_size for i in indexes.values() if i.world_size]
        return max(known) if known else None

    def index(self) -> Index:
        if self._index is not None:
            return self._index
        indexes = {p.key: p.reader.index() for p in self.parts}
        tree: dict = {}
        for part in self.parts:
            own = indexes[part.key].tree
            if part.nested is not None:
                if list(own) != [part.nested]:
                    raise BadInputError(
                        f"holds {sorted(map(str, own))} at the top, where the trainer saves "
                        f"one key {part.nested!r}",
                        path=self.src / part.file,
                        hint="this directory was not written by the trainer it looks like; "
                        "convert its parts one by one",
                    )
                own = own[part.nested]
            tree[part.key] = rekeyed(own, part.key + SEP)
        described = tuple(SourcePart(p.file, p.reader.format, p.key) for p in self.parts) + tuple(
            self.carried
        )
        self._index = Index(
            self.format, str(self.src), self.world_size(indexes), tree, parts=described
        )
        return self._index

    def members(self) -> frozenset[str]:
        """Return each part's files, under its name in SRC, and the carried files ``kept`` says."""
        read = {self._in_src(part, name) for part in self.parts for name in part.reader.members()}
        return frozenset(read | {p.file for p in self.carried if self.kept(p.file)})

    def _in_src(self, part: Part, name: str) -> str:
        """Return file ``name`` of ``part``'s reader relative to SRC (a part may be read from SRC itself)."""
        where = part.reader.src.relative_to(self.src).as_posix()
        if where == ".":
            return name
        return f"{where}/{name}" if name else where

    def stored_items(self) -> dict[str, list[StoredItem]]:
        """Return each part's items, under its name in SRC."""
        return {
            self._in_src(part, name): items
            for part in self.parts
            for name, items in part.reader.stored_items().items()
        }

    def kept(self, name: str) -> bool:
        """Return whether carried file ``name`` is one the trainer writes (else a stranger here)."""
        return False

    def read(
        self, metas: Sequence[TensorMeta], rows: Sequence[Rows], runtime
    ) -> list[torch.Tensor]:
        by_part: dict[str, list[int]] = {}
        for i, meta in enumerate(metas):
            by_part.setdefault(meta.key.split(SEP, 1)[0], []).append(i)
        out: list[torch.Tensor | None] = [None] * len(metas)
        for key, where in by_part.items():
            cut = len(key) + len(SEP)
            own = [replace(metas[i], key=metas[i].key[cut:]) for i in where]
            got = self._by_key[key].reader.read(own, [rows[i] for i in where], runtime)
            for i, tensor in zip(where, got):
                out[i] = tensor
        return out  # type: ignore[return-value]

    def check_selected(self, tree: dict) -> None:
        for part in self.parts:
            if part.key in tree:
                cut = len(part.key) + len(SEP)
                own = map_leaves(
                    tree[part.key],
                    lambda _p, leaf, cut=cut: (
                        replace(leaf, key=leaf.key[cut:]) if isinstance(leaf, TensorMeta) else leaf
                    ),
                )
                part.reader.check_selected(own if part.nested is None else {part.nested: own})


@dataclass(frozen=True)
class SubCheckpoint:
    """One part of a parts output: a checkpoint of ``tree`` written by ``writer`` into ``dir``."""

    dir: str
    format: str
    writer: type[Writer]
    tree: dict


def sub_plan(plan, fmt: str, tree: dict):
    """Return ``plan`` narrowed to ``tree`` (a part of its tree), written in format ``fmt``."""
    tensors = tuple(tensor_leaves(tree))
    metas = MappingProxyType({m.key: m for _, m in tensors})
    return replace(plan, format=fmt, tree=tree, tensors=tensors, metas=metas)


def _under(folder: str, frame: Frame) -> Frame:
    """Return ``frame`` with every file it names moved into ``folder``."""

    def moved(file: str) -> str:
        return f"{folder}/{file}" if file else folder

    records: dict[Record, Record] = {r: replace(r, file=moved(r.file)) for r in frame.records}
    regions = [
        replace(
            r, file=moved(r.file), record=records.get(r.record) if r.record is not None else None
        )
        for r in frame.regions
    ]
    pieces = [replace(p, file=moved(p.file)) for p in frame.pieces]
    # A file job's regions and records are placed by the job's file alone.
    files = [replace(j, file=moved(j.file)) for j in frame.files]
    return Frame(regions, list(records.values()), pieces, files)


class PartsWriter(Writer):
    """Writes each part with an existing writer into a subdirectory of DST; copies carried files.

    ``subcheckpoints`` says which part goes where; ``copies`` which files of SRC go
    into DST as they are. Every sub-writer frames in the same order on every process
    (their collectives pair up), and finishes on the coordinator.
    """

    def __init__(self, root: Path, plan):
        super().__init__(root, plan)
        self.subs = [
            (s.dir, s.writer(root / s.dir, sub_plan(plan, s.format, s.tree)))
            for s in self.subcheckpoints(plan)
        ]
        self.copied = self.copies(plan)
        # Where ranks write to disks they do not share, the engine copies these files
        # from the coordinator's disk to the others (a carried directory stays on its).
        self.every_copy = tuple(
            f"{d}/{name}" for d, w in self.subs for name in w.every_copy
        ) + tuple(name for src, name in self.copied if not src.is_dir())

    @abstractmethod
    def subcheckpoints(self, plan) -> list[SubCheckpoint]:
        """Return the checkpoints DST is made of."""

    def copies(self, plan) -> list[tuple[Path, str]]:
        """Return ``(file of SRC, name in DST)`` for every file copied unchanged."""
        return []

    def frame(self, runtime) -> Frame:
        frames = []
        for folder, writer in self.subs:

            def make(folder=folder) -> None:
                with writing(self.root / folder):
                    (self.root / folder).mkdir(exist_ok=True)

            runtime.agreed(make)
            writer.placement = self.placement
            frames.append(_under(folder, writer.frame(runtime)))
        return merge_frames(frames)

    def finish(self) -> None:
        for _, writer in self.subs:
            writer.finish()
        for src, name in self.copied:
            copy_entry(src, self.root / name, Path(self.plan.src))
