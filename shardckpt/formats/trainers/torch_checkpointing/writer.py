"""Writing ``torch-checkpointing`` for M target ranks: what ``CheckpointManager.save`` writes at M.

Each top-level key of the tree is an item. For target rank r (``shardckpt.formats.ranks.target_ranks``):

- an item holding tensors is stored as the source stored it (a torch-checkpointing
  source says which; otherwise ``torch.save``): ``<item>_<r>.pt`` holds rank r's state
  dict as FSDP2 at M holds it (each split tensor a ``Shard(0)`` DTensor of r's rows on a
  mesh of M, whole tensors plain, values as they are), or ``<item>_<r>.safetensors``
  holds r's local shards by dotted path;
- an item without tensors (a step counter) is ``<item>_<r>.pt`` for every r, as every
  rank of the job saves it.

``metadata.pkl`` comes last (coordinator) and lists every item holding tensors, as the
library lists items saved with a ``DefaultResharder``: each tensor ``Shard(0)`` over a
1-D mesh of M (``Replicate`` for a whole one) and each rank's file. The library's loader
at M reads it; at any other world size it reshards from it.
"""

from __future__ import annotations

import os
from dataclasses import replace

from shardckpt.core.errors import UsageError
from shardckpt.core.files import writing
from shardckpt.formats.base import Frame
from shardckpt.formats.hf.safetensors_file import layout
from shardckpt.formats.ranks.rank_file import Fills, dtensor_placeholders, frame_rank_file
from shardckpt.formats.ranks.target_ranks import TargetRanksWriter, create, job_mesh
from shardckpt.formats.trainers.torch_checkpointing.metadata import (
    METADATA_FILE,
    SAFETENSORS,
    TORCH,
    metadata_bytes,
    plain_file_name,
    sharding_dict,
)
from shardckpt.state.regions import Region, dim0_rows, row_elements
from shardckpt.state.tree import TensorMeta, dotted, walk


def _tensors(value: object) -> list[tuple[tuple, TensorMeta]]:
    return [(p, m) for p, m in walk({"": value}) if isinstance(m, TensorMeta)]


class TorchCheckpointingWriter(TargetRanksWriter):
    """Each target rank's item files, then ``metadata.pkl``."""

    every_copy = (METADATA_FILE,)

    def __init__(self, root, plan):
        super().__init__(root, plan)
        for key, value in plan.tree.items():
            if not isinstance(key, str) or not plain_file_name(f"{key}_0.pt"):
                raise UsageError(
                    f"top-level key {key!r} cannot name torch_checkpointing item files",
                    hint="rename it, or write --format dcp",
                )
            if isinstance(value, TensorMeta):
                raise UsageError(
                    f"'{key}' is a tensor at the top level, and torch_checkpointing items are "
                    "the top-level keys of a state dict",
                    hint="convert a checkpoint that nests its tensors under items such as "
                    "'model' and 'optim', or write --format dcp",
                )

    def _serialization(self, key: str) -> str:
        return self.plan.serializations.get(key, TORCH)

    def _file(self, key: str, rank: int) -> str:
        suffix = ".safetensors" if self._serialization(key) == SAFETENSORS else ".pt"
        return f"{key}_{rank}{suffix}"

    def frame_rank(self, rank: int) -> Frame:
        frames = []
        for key, value in self.plan.tree.items():
            if self._serialization(key) == SAFETENSORS and _tensors(value):
                frames.append(self._frame_safetensors(key, value, rank))
                continue
            fills: Fills = {}
            item_plan = replace(self.plan, tree={key: value})
            state = dtensor_placeholders(
                item_plan, rank, job_mesh(self.plan.world_size, rank), fills
            )
            frames.append(frame_rank_file(self.root / self._file(key, rank), state[key], fills))
        out = Frame()
        for frame in frames:
            out.regions += frame.regions
            out.records += frame.records
            out.pieces += frame.pieces
        return out

    def _local(self, meta: TensorMeta, rank: int) -> tuple[int, int, tuple[int, ...]]:
        """Return the elements [start, stop) of ``meta`` rank ``rank`` holds, and their shape."""
        if meta.key in self.plan.whole or not meta.shape:
            return 0, meta.numel, meta.shape
        first, last = dim0_rows(meta.shape, self.plan.world_size, rank)
        row = row_elements(meta)
        return first * row, last * row, (last - first, *meta.shape[1:])

    def _frame_safetensors(self, key: str, value: object, rank: int) -> Frame:
        file = self._file(key, rank)
        entries, spans = [], []
        for path, meta in _tensors(value):
            start, stop, shape = self._local(meta, rank)
            entries.append((dotted(path[1:]), TensorMeta(meta.key, shape, meta.dtype)))
            spans.append((meta.key, start, stop))
        header = layout(entries, {"format": "pt"}, file)
        os.close(create(self.root / file))
        header.write(self.root / file)
        regions = [
            Region(k, start, stop, file, placed.offset)
            for (k, start, stop), placed in zip(spans, header.regions)
        ]
        return Frame(regions)

    def finish(self) -> None:
        m = self.plan.world_size
        items = {}
        for key, value in self.plan.tree.items():
            tensors = _tensors(value)
            if not tensors:
                continue
            kind = self._serialization(key)
            items[key] = {
                "paths": {
                    path[1:]: sharding_dict(
                        meta.shape, meta.dtype, m, meta.key not in self.plan.whole
                    )
                    for path, meta in tensors
                },
                "files": {
                    r: (self._file(key, r), kind) if kind == SAFETENSORS else None for r in range(m)
                },
            }
        path = self.root / METADATA_FILE
        with writing(path), open(path, "wb") as f:
            f.write(metadata_bytes(m, items))
            f.flush()
            os.fsync(f.fileno())
