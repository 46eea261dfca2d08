"""Writing ``fsdp1-sharded`` and ``fsdp1-local`` for M target ranks: one ``rank_{r}.pt`` per rank.

Files are named by ``shardckpt.formats.ranks.rank_names.rank_file_name``.

Each process writes the files of the target ranks it acts for (``shardckpt.formats.ranks.target_ranks``),
reading only those ranks' parts of the source:
  - ``fsdp1-sharded``: each tensor a ``ShardedTensor`` of its dim-0 chunk (``torch.chunk``
    over M, as FSDP1's ``SHARDED_STATE_DICT``); tensors that stay whole (``plan.whole``:
    0-dim ``step``, buffers of a multi-rank source) are saved whole.
  - ``fsdp1-local``: per FSDP unit, ``_flat_param``: a 1-D ``ShardedTensor`` holding the
    valid part of rank r's padded flat shard at offset ``r * shard_numel``, as FSDP1's
    ``LOCAL_STATE_DICT``; with ``use_orig_params`` each parameter's piece of the shard too.
    The layout at (M, r) comes from FSDP1 (``shardckpt.formats.fsdp1.flat_layout``).
"""

from __future__ import annotations

from math import prod
from pathlib import Path

import torch

from shardckpt.codecs.zip_skeleton import fake_mode
from shardckpt.core.errors import UsageError
from shardckpt.formats.base import Frame
from shardckpt.formats.fsdp1.flat_layout import FLAT_PARAM, FlatLayout, flat_layouts
from shardckpt.formats.fsdp1.sharded_tensor_record import ShardedTensorRecord
from shardckpt.formats.ranks.rank_file import (
    Fills,
    frame_rank_file,
    placeholder_rows,
    placeholder_whole,
)
from shardckpt.formats.ranks.rank_names import rank_file_name
from shardckpt.formats.ranks.target_ranks import TargetRanksWriter
from shardckpt.formats.torch_save.file import storage_of
from shardckpt.state.regions import dim0_rows
from shardckpt.state.tree import TensorMeta, find_optimizers, map_leaves, model_prefix, subtree


def _dim0_shards(meta: TensorMeta, world_size: int) -> list[tuple[int, int, int]]:
    shards = []
    for q in range(world_size):
        a, b = dim0_rows(meta.shape, world_size, q)  # type: ignore[misc]
        if b > a:
            shards.append((q, a, b - a))
    return shards


class Fsdp1ShardedWriter(TargetRanksWriter):
    """``rank_{r}.pt`` of FSDP1 ``SHARDED_STATE_DICT``: each split tensor a ShardedTensor of r's chunk."""

    def rank_path(self, rank: int) -> Path:
        """Return target rank ``rank``'s file (a trainer's layout names it its own way)."""
        return self.root / rank_file_name(rank)

    def frame_rank(self, rank: int) -> Frame:
        plan, m = self.plan, self.plan.world_size
        fills: Fills = {}

        def place(_path, leaf):
            if not isinstance(leaf, TensorMeta):
                return leaf
            if leaf.key in plan.whole:
                return placeholder_whole(fills, leaf)
            local = placeholder_rows(fills, leaf, m, rank)
            return ShardedTensorRecord(
                local if local.shape[0] else None,
                leaf.shape,
                leaf.dtype,
                _dim0_shards(leaf, m),
                rank,
                m,
            )

        with fake_mode():
            state_dict = map_leaves(plan.tree, place)
        return frame_rank_file(self.rank_path(rank), state_dict, fills)


class Fsdp1LocalWriter(TargetRanksWriter):
    """``rank_{r}.pt`` of FSDP1 ``LOCAL_STATE_DICT``: per FSDP unit, rank r's flat shard."""

    def __init__(self, root: Path, plan):
        super().__init__(root, plan)
        if plan.flat_model is None:
            raise UsageError(
                "fsdp1-local output needs the model's flat-parameter layout",
                hint="pass --model pkg.module:factory and the --wrap classes training wraps",
            )
        if find_optimizers(plan.tree):
            raise UsageError(
                "fsdp1-local holds model state only (FSDP1 has no LOCAL_STATE_DICT optimizer state)",
                hint="pass --only model, or write the optimizer with --format fsdp1-sharded",
            )

    def frame_rank(self, rank: int) -> Frame:
        plan, m = self.plan, self.plan.world_size
        where = model_prefix(plan.tree)
        model = subtree(plan.tree, where)
        layouts = flat_layouts(plan.flat_model, m, rank, plan.use_orig_params)
        fills: Fills = {}
        with fake_mode():
            local = _local_model_state(model, layouts, fills, rank, m)
        out = dict(plan.tree)
        if where:
            out[where[0]] = local
        else:
            out = local
        return frame_rank_file(self.root / rank_file_name(rank), out, fills)


def _local_model_state(
    model: dict, layouts: list[FlatLayout], fills: Fills, r: int, m: int
) -> dict:
    """Return rank ``r``'s ``LOCAL_STATE_DICT`` of placeholders: buffers whole, each unit's flat shard."""
    in_units = set()
    for lay in layouts:
        in_units |= {lay.prefix + f for f in lay.fqns} | {lay.prefix + a for a, _ in lay.shared}
    missing = [f for lay in layouts for f in (lay.prefix + g for g in lay.fqns) if f not in model]
    if missing:
        raise UsageError(
            f"the model has parameter '{missing[0]}' but the checkpoint does not",
            hint="check --model against `shardckpt inspect`, or --rename the checkpoint's keys",
        )
    out: dict = {}
    for key, leaf in model.items():
        if key in in_units:
            continue
        out[key] = placeholder_whole(fills, leaf) if isinstance(leaf, TensorMeta) else leaf
    for lay in layouts:
        metas = [model[lay.prefix + f] for f in lay.fqns]
        valid = max(lay.shard_numel - lay.shard_numel_padded, 0)
        dtype = metas[0].dtype if metas else torch.float32
        shards = [
            (q, q * lay.shard_numel, n)
            for q in range(m)
            if (n := max(0, min(lay.shard_numel, lay.unpadded_numel - q * lay.shard_numel))) > 0
        ]
        # The file holds the valid part of the shard once, as FSDP1's own file does:
        # without the tail padding, and the parameter pieces viewing it.
        flat = torch.empty(valid, dtype=dtype)
        fills[storage_of(flat)] = flat_fills(metas, lay, r, valid)
        if lay.use_orig_params:
            # FSDP1 saves each parameter's piece of the shard, and a tied alias's too.
            piece_of = {}
            for fqn, piece in zip(lay.fqns, lay.pieces):
                start = piece.offset_in_shard if piece.in_shard else 0
                size = piece.numel_in_shard if piece.in_shard else 0
                piece_of[fqn] = flat[start : start + size]
                out[lay.prefix + fqn] = piece_of[fqn]
            for alias, primary in lay.shared:
                out[lay.prefix + alias] = piece_of[primary]
        out[lay.prefix + FLAT_PARAM] = ShardedTensorRecord(
            flat if valid > 0 else None, (lay.unpadded_numel,), dtype, shards, r, m
        )
    return out


def flat_fills(
    metas: list[TensorMeta], lay: FlatLayout, r: int, valid: int
) -> list[tuple[str, int, int, int]]:
    """Return what fills rank ``r``'s flat shard: each parameter's elements in it (padding stays 0)."""
    lo, hi = r * lay.shard_numel, r * lay.shard_numel + valid
    out = []
    for meta, (fqn, start), shape in zip(metas, lay.starts().items(), lay.shapes):
        if tuple(meta.shape) != tuple(shape):
            raise UsageError(
                f"'{lay.prefix}{fqn}' has shape {list(meta.shape)} in the checkpoint "
                f"but {list(shape)} in the model",
                hint="check that --model builds the trained model",
            )
        a, b = max(lo, start), min(hi, start + prod(shape))
        if a < b:
            out.append((meta.key, a - start, b - start, (a - lo) * meta.dtype.itemsize))
    return out
