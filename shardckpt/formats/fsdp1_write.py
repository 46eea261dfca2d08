"""Writing ``fsdp1-sharded`` and ``fsdp1-local`` for M target ranks: one ``rank_{r}.pt`` per rank.

Files are named by ``shardckpt.formats.rank_names.rank_file_name``.

Each process writes the files of the target ranks it acts for (``shardckpt.virtual``),
reading only those ranks' parts of the source:
  - ``fsdp1-sharded``: each tensor a ``ShardedTensor`` of its dim-0 chunk (``torch.chunk``
    over M, as FSDP1's ``SHARDED_STATE_DICT``); tensors that stay whole (``plan.whole``:
    0-dim ``step``, buffers of a multi-rank source) are saved whole.
  - ``fsdp1-local``: per FSDP unit, ``_flat_param``: a 1-D ``ShardedTensor`` holding the
    valid part of rank r's padded flat shard at offset ``r * shard_numel``, as FSDP1's
    ``LOCAL_STATE_DICT``; with ``use_orig_params`` each parameter's piece of the shard too.
    The layout at (M, r) comes from FSDP1 (``shardckpt.flat_layout``).
"""

from __future__ import annotations

from math import prod
from pathlib import Path

import torch

from shardckpt.errors import UsageError
from shardckpt.flat_layout import FLAT_PARAM, FlatLayout, FlatModel, flat_layouts
from shardckpt.formats.base import Reader
from shardckpt.formats.rank_file import own_bytes, save_rank_file
from shardckpt.formats.rank_names import rank_file_name
from shardckpt.formats.sharded_tensor_record import ShardedTensorRecord
from shardckpt.plan import ConvertPlan, dim0_rows
from shardckpt.tree import TensorMeta, find_optimizers, map_leaves, model_prefix, subtree
from shardckpt.virtual import virtual_ranks


def _dim0_shards(meta: TensorMeta, world_size: int) -> list[tuple[int, int, int]]:
    shards = []
    for q in range(world_size):
        a, b = dim0_rows(meta.shape, world_size, q)  # type: ignore[misc]
        if b > a:
            shards.append((q, a, b - a))
    return shards


FSDP1_FORMATS = ("fsdp1-sharded", "fsdp1-local")


def refuse_one_rank(fmt: str, world_size: int) -> None:
    """Refuse an FSDP1 output for one rank: FSDP1 on one rank runs ``NO_SHARD``.

    ``api.convert`` calls it with the other option checks, before DST is locked.

    Its state dicts then hold whole tensors under the parameters' own names (no
    ShardedTensor, no flat parameter), so a sharded layout of one rank would not load.
    """
    if world_size == 1:
        raise UsageError(
            f"--format {fmt} for --world-size 1: FSDP1 on one rank runs NO_SHARD, whose "
            "state dicts hold whole tensors, not shards",
            hint="convert --to full for a one-rank job (it loads with FULL_STATE_DICT), "
            "or pass --world-size 2 or more",
        )


def write_fsdp1_sharded(path: Path, plan: ConvertPlan, reader: Reader, runtime) -> None:
    """Write ``rank_{r}.pt`` of FSDP1 ``SHARDED_STATE_DICT`` for every target rank this process acts for."""
    m = plan.world_size

    def one(r: int) -> None:
        def place(_path, leaf):
            if not isinstance(leaf, TensorMeta):
                return leaf
            if leaf.key in plan.whole:
                return own_bytes(reader.read([leaf], [None], runtime)[0])
            rows = dim0_rows(leaf.shape, m, r)
            local = reader.read([leaf], [rows], runtime)[0] if rows[1] > rows[0] else None
            return ShardedTensorRecord(local, leaf.shape, leaf.dtype, _dim0_shards(leaf, m), r, m)

        save_rank_file(map_leaves(plan.tree, place), path / rank_file_name(r))

    # One agreed step for all of this process's target ranks: processes act for
    # different numbers of them, and each agreed step is a collective.
    targets = virtual_ranks(m, runtime.rank, runtime.world_size)
    runtime.agreed(lambda: [one(r) for r in targets])


def write_fsdp1_local(
    path: Path,
    plan: ConvertPlan,
    reader: Reader,
    flat_model: FlatModel | None,
    use_orig_params: bool,
    runtime,
) -> None:
    """Write ``rank_{r}.pt`` of FSDP1 ``LOCAL_STATE_DICT`` for every target rank this process acts for."""
    m = plan.world_size
    if flat_model is None:
        raise UsageError(
            "fsdp1-local output needs the model's flat-parameter layout",
            hint="pass --model pkg.module:factory and the --wrap classes training wraps",
        )
    if find_optimizers(plan.tree):
        raise UsageError(
            "fsdp1-local holds model state only (FSDP1 has no LOCAL_STATE_DICT optimizer state)",
            hint="pass --only model, or write the optimizer with --format fsdp1-sharded",
        )
    where = model_prefix(plan.tree)
    model = subtree(plan.tree, where)

    def one(r: int) -> None:
        local = _local_model_state(
            model, flat_layouts(flat_model, m, r, use_orig_params), reader, runtime, r, m
        )
        out = dict(plan.tree)
        if where:
            out[where[0]] = local
        else:
            out = local
        save_rank_file(out, path / rank_file_name(r))

    # One agreed step for all of this process's target ranks: processes act for
    # different numbers of them, and each agreed step is a collective.
    targets = virtual_ranks(m, runtime.rank, runtime.world_size)
    runtime.agreed(lambda: [one(r) for r in targets])


def _local_model_state(
    model: dict, layouts: list[FlatLayout], reader: Reader, runtime, r: int, m: int
) -> dict:
    """Return rank ``r``'s ``LOCAL_STATE_DICT``: buffers whole, each unit's flat shard."""
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
        out[key] = (
            own_bytes(reader.read([leaf], [None], runtime)[0])
            if isinstance(leaf, TensorMeta)
            else leaf
        )
    for lay in layouts:
        shard = _flat_shard(model, lay, reader, runtime, r)
        valid = lay.shard_numel - lay.shard_numel_padded
        shards = [
            (q, q * lay.shard_numel, n)
            for q in range(m)
            if (n := max(0, min(lay.shard_numel, lay.unpadded_numel - q * lay.shard_numel))) > 0
        ]
        # The file holds the valid part of the shard once, as FSDP1's own file does:
        # without the tail padding, and the parameter pieces viewing it.
        flat = own_bytes(shard[: max(valid, 0)])
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
            flat if valid > 0 else None, (lay.unpadded_numel,), shard.dtype, shards, r, m
        )
    return out


def _flat_shard(model: dict, lay: FlatLayout, reader: Reader, runtime, r: int) -> torch.Tensor:
    """Return rank ``r``'s padded flat shard: its parameters' elements, zeros for every padding."""
    lo, hi = r * lay.shard_numel, (r + 1) * lay.shard_numel
    metas = [model[lay.prefix + f] for f in lay.fqns]
    shard = torch.zeros(lay.shard_numel, dtype=metas[0].dtype if metas else torch.float32)
    for meta, (fqn, start), shape in zip(metas, lay.starts().items(), lay.shapes):
        if tuple(meta.shape) != tuple(shape):
            raise UsageError(
                f"'{lay.prefix}{fqn}' has shape {list(meta.shape)} in the checkpoint "
                f"but {list(shape)} in the model",
                hint="check that --model builds the trained model",
            )
        numel = prod(shape)
        a, b = max(lo, start), min(hi, start + numel)
        if a >= b:
            continue
        row = prod(shape[1:]) if shape else 1
        first, last = (a - start) // row, -(-(b - start) // row)
        rows = reader.read([meta], [(first, last) if shape else None], runtime)[0].reshape(-1)
        skip = a - start - first * row
        shard[a - lo : b - lo] = rows[skip : skip + (b - a)]
    return shard
