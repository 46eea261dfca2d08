"""DCP's ``.metadata`` for M target ranks, written as ``FileSystemWriter.finish`` writes it, streamed.

``finish`` pickles one ``Metadata`` holding every chunk of every tensor and where each
lies (at 1,024 ranks and 2,000 tensors, a million chunks: 3 GB of objects while
``pickle.dump`` writes them). Here the same ``Metadata`` is described with its chunk
lists and ``storage_data`` given lazily, each chunk and entry as its fields
(``codecs.pickle_stream``), and written with the same bytes, in the order DCP's own
planning gives (``save_plan.DcpSavePlan``): tensors by the first rank that keeps them,
their chunks rank by rank, ``storage_data`` rank by rank, each rank's values before
its tensors. Each name is one ``str`` object throughout (interned), as it is in
``finish``'s own ``Metadata`` however many processes wrote (``writer._one_object_per_name``).
"""

from __future__ import annotations

import heapq
import math
import sys
from collections.abc import Callable, Iterator, Mapping

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from shardckpt.codecs.pickle_stream import LazyDict, LazyList, Template, filled
from shardckpt.codecs.zip_skeleton import TensorBlob, tensor_blob
from shardckpt.core.torch_internals import dcp_storage_info
from shardckpt.formats.dcp.save_plan import SHARD, VALUE, WHOLE, DcpSavePlan, Split

CHUNK = Template(
    ChunkStorageMetadata,
    ("offsets", "sizes"),
    lambda offsets, sizes: ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
    frozenset({"offsets", "sizes"}),
)
TENSOR_INDEX = Template(
    MetadataIndex,
    ("fqn", "index", "offset"),
    lambda fqn, index, offset: MetadataIndex(fqn, offset, index),
    frozenset({"offset"}),
)
VALUE_INDEX = Template(
    MetadataIndex, ("fqn", "index"), lambda fqn, index: MetadataIndex(fqn, None, index)
)


def _info_template() -> Template:
    info = dcp_storage_info()
    return Template(
        info,
        ("relative_path", "offset", "length"),
        lambda path, offset, length: info(path, offset, length),
    )


def data_file(rank: int) -> str:
    """Return target rank ``rank``'s data file, as ``FileSystemWriter`` names it (one file per rank)."""
    return f"__{rank}_0.distcp"


class FileLayout:
    """Where each item of a target rank's data file lies: its values, then its tensors, as ``torch.save`` blobs."""

    def __init__(self, save: DcpSavePlan, value_bytes: Callable[[int], bytes]):
        self.save = save
        self.value_bytes = value_bytes
        entries = save.entries
        self._blobs: dict[tuple, TensorBlob] = {}
        self._shards = [i for i, e in enumerate(entries) if e.kind == SHARD]
        self._least_empty = min(
            (entries[i].split.empty_from for i in self._shards),  # type: ignore[union-attr]
            default=save.world_size,
        )
        # The entries several ranks hold, by the rank that stores each (values first).
        self._owned: dict[int, list[int]] = {}
        for index, rank in sorted(save.owner.items()):
            self._owned.setdefault(rank, []).append(index)
        # Bytes of one row of every split tensor, by split: what a rank's file holds of them.
        self._row_bytes: dict[Split, int] = {}
        for index in self._shards:
            entry = entries[index]
            row = math.prod(entry.meta.shape[1:]) * entry.meta.dtype.itemsize  # type: ignore[union-attr]
            self._row_bytes[entry.split] = self._row_bytes.get(entry.split, 0) + row  # type: ignore[index]

    def blob(self, sizes: tuple[int, ...], dtype: torch.dtype) -> TensorBlob:
        """Return the ``torch.save`` blob of a chunk of ``sizes`` and ``dtype``."""
        key = (sizes, dtype)
        found = self._blobs.get(key)
        if found is None:
            found = self._blobs[key] = tensor_blob(sizes, dtype)
        return found

    def data_bytes(self, rank: int) -> int:
        """Return the tensor bytes ``rank``'s file holds."""
        entries = self.save.entries
        total = sum(split.spans[rank][1] * row for split, row in self._row_bytes.items())
        for index in self._owned.get(rank, ()):
            entry = entries[index]
            if entry.kind == WHOLE:
                total += entry.meta.numel * entry.meta.dtype.itemsize  # type: ignore[union-attr]
        return total

    def values(self, rank: int) -> list[int]:
        """Return the value entries ``rank``'s file holds, in order."""
        entries = self.save.entries
        return [i for i in self._owned.get(rank, ()) if entries[i].kind == VALUE]

    def tensors(self, rank: int) -> Iterator[tuple[int, int, int]]:
        """Yield ``(entry, first row, rows)`` for each tensor item of ``rank``'s file, in order."""
        entries = self.save.entries
        shards = self._shards
        if rank >= self._least_empty:
            shards = [i for i in shards if entries[i].split.empty_from > rank]  # type: ignore[union-attr]
        owned = [i for i in self._owned.get(rank, ()) if entries[i].kind != VALUE]
        for index in heapq.merge(shards, owned) if owned else shards:
            entry = entries[index]
            if entry.kind == SHARD:
                first, count = entry.split.spans[rank]  # type: ignore[union-attr]
                yield index, first, count
            else:
                yield index, 0, entry.meta.shape[0] if entry.meta.shape else 1  # type: ignore[union-attr]

    def items(self, rank: int) -> Iterator[tuple[int, int, int, int, TensorBlob | None]]:
        """Yield ``(entry, offset, first row, rows, blob)`` for each item of ``rank``'s file, in order.

        A value's blob is None (its bytes are ``value_bytes``); a 0-dim tensor has one "row".
        """
        offset = 0
        for index in self.values(rank):
            yield index, offset, 0, 0, None
            offset += len(self.value_bytes(index))
        entries = self.save.entries
        for index, first, count in self.tensors(rank):
            meta = entries[index].meta
            assert meta is not None
            sizes = (count, *meta.shape[1:]) if meta.shape else ()
            blob = self.blob(sizes, meta.dtype)
            yield index, offset, first, count, blob
            offset += blob.size

    def hint(self, index: int, rank: int) -> int:
        """Return the position of ``rank``'s chunk of tensor entry ``index`` in ``.metadata``'s list."""
        entry = self.save.entries[index]
        if entry.kind != SHARD:
            return 0
        return min(rank, entry.split.empty_from)  # type: ignore[union-attr]


def metadata(
    layout: FileLayout,
    mappings: Mapping[str, tuple],
    storage_meta: StorageMeta | None,
    version: str,
) -> Metadata:
    """Return the ``Metadata`` ``finish`` would write, its chunk lists and ``storage_data`` lazy."""
    save = layout.save
    entries = save.entries
    name = sys.intern
    described: dict[str, object] = {}
    for index in save.metadata_order():
        entry = entries[index]
        if entry.kind == VALUE:
            described[entry.fqn] = BytesStorageMetadata()
            continue
        ranks = save.chunk_ranks(index)
        assert entry.meta is not None
        described[entry.fqn] = TensorStorageMetadata(
            properties=entry.properties(ranks[0]),
            size=torch.Size(entry.meta.shape),
            chunks=LazyList(
                len(ranks), lambda e=entry, rs=ranks: (filled(CHUNK, *e.chunk(r)) for r in rs)
            ),
        )
    planner_data = {
        name(k): tuple(name(p) if type(p) is str else p for p in path)
        for k, path in mappings.items()
    }
    return Metadata(
        state_dict_metadata=described,
        planner_data=planner_data,
        storage_data=LazyDict(storage_count(save), lambda: _storage_items(layout)),
        storage_meta=storage_meta,
        version=version,
    )


def storage_count(save: DcpSavePlan) -> int:
    """Return how many items ``.metadata``'s ``storage_data`` lists: every chunk and every value."""
    return sum(
        len(save.chunk_ranks(i)) if e.kind != VALUE else 1 for i, e in enumerate(save.entries)
    )


def _storage_items(layout: FileLayout) -> Iterator[tuple]:
    """Yield ``storage_data``'s entries: rank by rank, each item's index and where it lies."""
    info = _info_template()
    entries = layout.save.entries
    zeros = {}
    for rank in range(layout.save.world_size):
        path = data_file(rank)  # one object for the rank's file, as its write results share it
        for index, offset, first, _, blob in layout.items(rank):
            entry = entries[index]
            if blob is None:
                yield (
                    filled(VALUE_INDEX, entry.fqn, None),
                    filled(info, path, offset, len(layout.value_bytes(index))),
                )
                continue
            ndim = len(entry.meta.shape)  # type: ignore[union-attr]
            rest = zeros.get(ndim)
            if rest is None:
                rest = zeros[ndim] = (0,) * max(ndim - 1, 0)
            offsets = (first, *rest) if ndim else ()
            yield (
                filled(TENSOR_INDEX, entry.fqn, layout.hint(index, rank), offsets),
                filled(info, path, offset, blob.size),
            )
