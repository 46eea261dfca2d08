"""What every format module provides: an ``Index`` of the source and a Reader/Writer pair.

Call order for a conversion (see ``shardckpt/convert.py``):
  1) (all ranks) ``Reader(src, trust_pickle).index()``: metadata and plain values only.
  2) (all ranks) ``Reader.read(metas, rows, runtime)`` per batch: each rank its rows.
  3) (all ranks) ``Writer.frame``; the engine fills the regions; (coordinator) ``Writer.finish``.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from shardckpt.core.lazy_torch import torch
from shardckpt.core.placement import shared
from shardckpt.state.checksums import Written
from shardckpt.state.regions import FileJob, Piece, Record, Region
from shardckpt.state.tree import TensorMeta, map_leaves, tensor_leaves

# Rows [start, stop) of dim 0, or None for the whole tensor.
Rows = tuple[int, int] | None


def rows_shape(meta: TensorMeta, rows: Rows) -> tuple[int, ...]:
    """Return the shape of rows ``rows`` of ``meta`` (its own shape for None)."""
    return meta.shape if rows is None else (rows[1] - rows[0],) + meta.shape[1:]


@dataclass(frozen=True)
class SourcePart:
    """One file (or directory) of a source made of several (``formats/parts.py``)."""

    file: str
    """Relative to SRC."""
    format: str
    """The format it is read in, or ``"file"`` for one carried as it is, unread."""
    key: str | None
    """The top-level key of the tree it gives; None for a file carried unread."""
    note: str = ""
    """Why a carried file is not read (what it holds)."""


@dataclass(frozen=True)
class StoredItem:
    """One item of a data file that stores several one after another (DCP's ``.distcp``)."""

    offset: int
    length: int
    key: str
    """The key it holds a chunk of (or the value of), as messages name it."""
    zip: bool
    """Whether it is a ``torch.save`` zip as stored (not transformed by an extension)."""


@dataclass(frozen=True)
class StoredRun:
    """Bytes of a tensor exactly as they are to be written, where they lie in a source file."""

    path: Path
    offset: int
    """Byte offset of the first of them in ``path``."""
    length: int
    written: Written | None
    """The record (a DCP item's storage) they lie in, whose CRC-32 they are checked against."""
    names: tuple[str, ...] | None = None
    """The tensors that record holds, as errors name them; None: the tensor written from it."""


@dataclass
class Index:
    """A source as metadata: its format, world size and tree of ``TensorMeta`` and values."""

    format: str
    src: str
    world_size: int | None
    tree: dict
    parts: tuple[SourcePart, ...] = ()
    """For a source made of several files: which file gives which top-level key, and
    which files are carried unread (never dropped silently: ``inspect`` lists them);
    Lightning's ``meta.pt`` is a part beside the DCP data."""
    serializations: dict[str, str] | None = None
    """For a format that stores each top-level item in files of its own (torch-checkpointing):
    how each item is serialized, so an output in the same format stores it alike."""

    def tensors(self) -> list[tuple[tuple, TensorMeta]]:
        """Return ``(path, meta)`` for every tensor leaf, in tree order."""
        return tensor_leaves(self.tree)


class Reader(ABC):
    """Reads one source format: metadata first, then tensor rows on demand."""

    format: str = ""

    def __init__(self, src: str | os.PathLike, trust_pickle: bool = False):
        self.src = Path(src)
        self.trust_pickle = trust_pickle

    @abstractmethod
    def index(self) -> Index:
        """Return the source's tree with ``TensorMeta`` leaves; reads no tensor data."""

    @abstractmethod
    def read(
        self, metas: Sequence[TensorMeta], rows: Sequence[Rows], runtime
    ) -> list[torch.Tensor]:
        """Return, for each meta, the requested rows (or all of it) as a CPU or device tensor."""

    def read_into(
        self,
        metas: Sequence[TensorMeta],
        rows: Sequence[Rows],
        outs: Sequence[torch.Tensor],
        runtime,
    ) -> list[torch.Tensor]:
        """Return ``read``'s tensors, filled into ``outs`` (contiguous, of their shapes and dtypes) where this reader can.

        Memory given again and again spares a fresh allocation per read, whose pages the
        kernel zeroes on first touch (a third of ``diff``'s reading time at 1 GB); a reader
        that cannot fill given memory returns its own tensors.
        """
        return self.read(metas, rows, runtime)

    def read_spans(
        self, requests: Sequence[tuple[TensorMeta, Rows]], runtime
    ) -> list[torch.Tensor]:
        """Return the rows of each request; one tensor may be asked for more than once.

        The engine calls it once per step on every rank; a reader whose reads are
        collectives (``exchange.SharedReader``) relies on that.
        """
        return read_grouped(self, requests, runtime)

    def stored_runs(self, meta: TensorMeta, start: int, stop: int) -> list[StoredRun] | None:
        """Return where elements [start, stop) of ``meta`` lie in SRC's files, in order, as they are.

        None (the default) where they must be read through ``read``: a format that
        transforms or scatters its bytes, a cast, rows that other ranks bring. The engine
        maps runs instead of copying them through a buffer (``engine.stored_copy``).
        """
        return None

    def files_for(self, meta: TensorMeta, rows: Rows) -> list[tuple[Rows, frozenset[str]]]:
        """Return ``rows`` of ``meta`` cut where the files holding them change, with those files.

        File names are relative to SRC (``""`` is a one-file SRC itself), as
        ``shardckpt.core.sight`` lists them. Only a format that can be read from files
        spread over the ranks' own disks says (``Format.src_local``).
        """
        raise NotImplementedError(f"{self.format} sources are read from one shared filesystem")

    def members(self) -> frozenset[str]:
        """Return the files this checkpoint is made of, read or carried, relative to SRC.

        POSIX paths, ``""`` for a one-file SRC itself; called after ``index``. Whatever
        else a directory holds is no part of it: ``--overwrite`` will not delete it.
        """
        return frozenset({""})

    def stored_items(self) -> dict[str, list[StoredItem]]:
        """Return the items of each data file that holds several, by file relative to SRC.

        ``shardckpt verify`` checks each item's zip and that the items account for every
        byte of the file; a file not named here is checked as a whole.
        """
        return {}

    def notes(self) -> list[str]:
        """Return what ``inspect`` should warn about this source that its index cannot show."""
        return []

    def check_selected(self, tree: dict) -> None:
        """Raise when this source cannot give what ``tree`` (the part of its index to be read) holds.

        Called before the first read, identically on every rank.
        """
        # Most formats can give every leaf of their index.
        return None


@dataclass
class Frame:
    """What framing left for one process to do: regions to fill, and the checksums it owes."""

    regions: list[Region] = field(default_factory=list)
    """The regions this process fills (``shardckpt.state.regions``)."""
    records: list[Record] = field(default_factory=list)
    """The zip records this process framed, whose CRC-32 is patched once every rank wrote."""
    pieces: list[Piece] = field(default_factory=list)
    """Bytes framing already wrote into those records (a DTensor's mesh, for instance)."""
    files: list[FileJob] = field(default_factory=list)
    """Files this process writes whole, laid out as the engine reaches them (per-rank files)."""


class Writer(ABC):
    """Writes one output format from a plan, in three steps the engine (``shardckpt/engine/fill.py``) runs:

    1) ``frame(runtime)`` (every process): lay the files out from the plan alone
       (headers, ``torch.save`` skeletons) and return this process's ``Frame``;
    2) the engine fills every process's regions with the source's bytes, and patches
       the CRC-32 of every record;
    3) ``finish()`` (coordinator): write what comes last (an index, DCP's ``.metadata``).
    """

    def __init__(self, root: Path, plan):
        self.root = root
        self.plan = plan
        # Which target ranks' files each process writes (``shardckpt.core.placement``); set by
        # ``api.convert`` once DST is open, None for a DST every rank sees.
        self.placement = None

    def targets(self, runtime) -> list[int]:
        """Return the target ranks whose files this process frames and fills."""
        placement = self.placement or shared(runtime.rank, runtime.world_size)
        return placement.targets(self.plan.world_size)

    # Files ``finish`` writes that every copy of DST needs, where ranks write to several disks.
    every_copy: tuple[str, ...] = ()

    @abstractmethod
    def frame(self, runtime) -> Frame:
        """Create the files this process frames and return its ``Frame``; may run collectives."""

    def finish(self) -> None:
        """Write what the format writes last, on the coordinator, once every byte is in."""
        return None

    def written_tree(self, tree: dict) -> dict:
        """Return ``tree`` as DST reads back, where the format changes its plain values.

        ``--verify`` compares DST with it. A format that records what it was written as
        (DeepSpeed's ``ds_config`` of another ZeRO stage) says so here; tensors never change.
        """
        return tree


def read_grouped(
    reader: Reader, requests: Sequence[tuple[TensorMeta, Rows]], runtime
) -> list[torch.Tensor]:
    """Return ``reader.read`` of every request, calling it once per round of distinct tensors.

    A reader takes each tensor once per call, so rows of one tensor that lie apart
    (two target ranks' shards) go in separate calls.
    """
    out: list[torch.Tensor | None] = [None] * len(requests)
    left = list(range(len(requests)))
    while left:
        seen: set[str] = set()
        now, later = [], []
        for i in left:
            key = requests[i][0].key
            (later if key in seen else now).append(i)
            seen.add(key)
        tensors = reader.read([requests[i][0] for i in now], [requests[i][1] for i in now], runtime)
        for i, t in zip(now, tensors):
            out[i] = t
        left = later
    return out  # type: ignore[return-value]


def rekeyed(tree: object, prefix: str) -> object:
    """Return ``tree`` with every tensor's reader key prefixed by ``prefix``."""

    def fn(_path, leaf):
        return replace(leaf, key=prefix + leaf.key) if isinstance(leaf, TensorMeta) else leaf

    return map_leaves(tree, fn)


def read_routed(
    route: Callable[[str], tuple[Reader, str]],
    metas: Sequence[TensorMeta],
    rows: Sequence[Rows],
    runtime,
) -> list[torch.Tensor]:
    """Return each meta's rows, read by the reader ``route(meta.key)`` names under the key it gives.

    For a source joined from several readers' trees (tensor keys told apart by a prefix,
    ``rekeyed``): each reader is called once, with its own keys.
    """
    by_reader: dict[int, tuple[Reader, list[int], list[TensorMeta]]] = {}
    for i, meta in enumerate(metas):
        reader, key = route(meta.key)
        entry = by_reader.setdefault(id(reader), (reader, [], []))
        entry[1].append(i)
        entry[2].append(replace(meta, key=key))
    out: list[torch.Tensor | None] = [None] * len(metas)
    for reader, where, own in by_reader.values():
        for i, tensor in zip(where, reader.read(own, [rows[i] for i in where], runtime)):
            out[i] = tensor
    return out  # type: ignore[return-value]
