"""DCP's save planning for M target ranks, done once for the tree instead of once per rank.

``dcp.save`` at M has each of M ranks plan its state dict (one ``WriteItem`` per entry:
a value, a whole tensor, or its ``Shard(0)`` chunk of a split one), and rank 0 merges
the M plans: ``dedup_save_plans`` gives each entry every rank holds (values, whole
tensors, the empty chunk of the ranks past a tensor's rows) to one of them, and
``create_default_global_save_plan`` lists each tensor's chunks, rank by rank, in
``.metadata``. For FSDP2's state dicts that depends only on the tree and M, so it is
computed here from the tree once (``DcpSavePlan``): each entry's chunk for each rank
comes from torch's own ``Shard(0)`` split (``state.regions.dim0_rows``), each
``WriteItem``'s properties from DCP's own ``TensorProperties.create_from_tensor``, and
dedup follows ``dedup_save_plans`` step by step (the ranks' planned sizes, the first
rank to see each entry, ties broken as its sets iterate). No placeholder DTensor is
built per target rank, and nothing is gathered: every process derives the same plan.
``tests/dist/test_reshard.py`` holds its ``.metadata`` to what ``dcp.save`` of FSDP2 at M
writes, entry by entry, and ``tests/dist/test_golden_outputs.py`` every file to the bytes
written before it.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from shardckpt.state.regions import Split
from shardckpt.state.tree import TensorMeta

VALUE, WHOLE, SHARD = "value", "whole", "shard"


@dataclass(frozen=True)
class Entry:
    """One entry of the flat state dict DCP saves, in its order."""

    fqn: str
    """DCP's flat key (its path joined with dots), interned."""
    kind: str
    """``value``, ``whole`` (a tensor every rank holds whole) or ``shard`` (split on dim 0)."""
    meta: TensorMeta | None = None
    value: object = None
    split: Split | None = None
    cost: int = 1
    """What ``dedup_save_plans`` counts for it: ``WriteItem.tensor_storage_size() or 1``."""

    def chunk(self, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Return the (offsets, sizes) of this tensor's chunk on ``rank``."""
        assert self.meta is not None
        shape = tuple(self.meta.shape)
        if self.split is None:
            return (0,) * len(shape), shape
        first, count = self.split.spans[rank]
        return (first, *(0,) * (len(shape) - 1)), (count, *shape[1:])

    def properties(self, rank: int) -> TensorProperties:
        """Return DCP's ``TensorProperties`` of this tensor's item on ``rank`` (a new object)."""
        assert self.meta is not None
        local = torch.empty(self.chunk(rank)[1], dtype=self.meta.dtype, device="meta")
        return TensorProperties.create_from_tensor(local)


def storage_cost(meta: TensorMeta) -> int:
    """Return what ``dedup_save_plans`` counts for a tensor item of ``meta`` (its global size)."""
    item = WriteItem(
        index=MetadataIndex("x"),
        type=WriteItemType.TENSOR,
        tensor_data=TensorWriteData(
            chunk=None,  # type: ignore[arg-type]
            properties=TensorProperties(dtype=meta.dtype),
            size=torch.Size(meta.shape),
        ),
    )
    return item.tensor_storage_size() or 1


class DcpSavePlan:
    """What DCP's planning gives M target ranks: each rank's entries, who stores the shared ones, the chunk lists."""

    def __init__(self, entries: Sequence[Entry], world_size: int):
        self.entries = list(entries)
        self.world_size = world_size
        self.owner = _dedup(self.entries, world_size)
        """For each entry that is no rank's own chunk (by index): the rank that stores it."""

    def items(self, rank: int) -> Iterator[int]:
        """Yield the indices of the entries ``rank``'s deduplicated plan keeps, in order."""
        owner = self.owner
        for index, entry in enumerate(self.entries):
            if entry.kind == SHARD and rank < entry.split.empty_from:  # type: ignore[union-attr]
                yield index
            elif owner.get(index, rank) == rank:
                yield index

    def first_rank(self, index: int) -> int:
        """Return the first rank whose deduplicated plan keeps entry ``index``."""
        entry = self.entries[index]
        if entry.kind == SHARD and entry.split.empty_from > 0:  # type: ignore[union-attr]
            return 0
        return self.owner.get(index, 0)

    def chunk_ranks(self, index: int) -> list[int]:
        """Return the ranks whose chunk of tensor entry ``index`` ``.metadata`` lists, in its order."""
        entry = self.entries[index]
        if entry.kind != SHARD:
            return [self.owner.get(index, 0)]
        assert entry.split is not None
        ranks = list(range(entry.split.empty_from))
        if index in self.owner:
            ranks.append(self.owner[index])
        return ranks

    def metadata_order(self) -> list[int]:
        """Return the entries in the order ``.metadata`` lists them: by the first rank keeping each."""
        return sorted(range(len(self.entries)), key=lambda i: (self.first_rank(i), i))


def _dedup(entries: Sequence[Entry], world_size: int) -> dict[int, int]:
    """Return, for each entry that is no rank's own chunk, the rank ``dedup_save_plans`` stores it on.

    As ``dedup_save_plans`` does it: entries in the order they first appear (rank 0's
    entries in order, then each later rank's that no earlier rank held), each given to
    the rank with the least planned bytes so far among those holding it (the first such
    in the order its set of ranks iterates), whose count then grows by the entry's cost;
    an entry one rank holds alone counts for that rank.
    """
    owner: dict[int, int] = {}
    size = [0] * world_size
    everyone = _rank_set(0, world_size)
    # Shared entries first seen at rank r > 0: the empty chunks of tensors split over r ranks.
    first_empty: dict[int, list[int]] = {}
    for index, entry in enumerate(entries):
        if entry.kind == SHARD and entry.split.empty_from > 0:  # type: ignore[union-attr]
            if entry.split.empty_from < world_size:  # type: ignore[union-attr]
                first_empty.setdefault(entry.split.empty_from, []).append(index)  # type: ignore[union-attr]
    # Rank 0's section: every entry appears there, but a split tensor's empty chunk.
    for index, entry in enumerate(entries):
        if entry.kind == SHARD and entry.split.empty_from > 0:  # type: ignore[union-attr]
            size[0] += entry.cost
        else:
            chosen = min(everyone, key=size.__getitem__)
            owner[index] = chosen
            size[chosen] += entry.cost
    # Each later rank's section: its own chunks, and the empty chunks first seen there.
    held = _HeldCosts(entries)
    for rank in range(1, world_size):
        if rank not in first_empty:
            size[rank] += held.beyond(rank)
            continue
        candidates = _rank_set(rank, world_size)
        for index, entry in enumerate(entries):
            if entry.kind != SHARD:
                continue
            empty_from = entry.split.empty_from  # type: ignore[union-attr]
            if rank < empty_from:
                size[rank] += entry.cost
            elif empty_from == rank:
                chosen = min(candidates, key=size.__getitem__)
                owner[index] = chosen
                size[chosen] += entry.cost
    return owner


def _rank_set(start: int, stop: int) -> set[int]:
    """Return ranks [start, stop) as ``dedup_save_plans`` builds its set: added in rank order."""
    ranks: set[int] = set()
    for rank in range(start, stop):
        ranks.add(rank)
    return ranks


class _HeldCosts:
    """The chunks each rank holds of split tensors, summed by cost: their rows reach past it."""

    def __init__(self, entries: Sequence[Entry]):
        reach = sorted(
            (e.split.empty_from, e.cost)  # type: ignore[union-attr]
            for e in entries
            if e.kind == SHARD and e.split.empty_from > 0  # type: ignore[union-attr]
        )
        self._ends = [end for end, _ in reach]
        self._after = list(accumulate((cost for _, cost in reversed(reach)), initial=0))[::-1]

    def beyond(self, rank: int) -> int:
        """Return the summed cost of the split tensors whose rows reach past ``rank``."""
        return self._after[bisect_right(self._ends, rank)]
