"""The conversion pipeline: reader -> plan -> (collective) -> writer, batch by batch.

Call order (every rank runs every step; ``Runtime.agreed`` turns a failure on one
rank into the same error on all of them before the next collective). ``api.convert``
opens the staging path before and commits it after (``shardckpt.staging``):
  1) a full writer lays out its file from the plan alone.
  2) per batch: (all) read own rows -> (all) gather to rank 0 -> (rank 0) write whole
     tensor; or, for a sharded DST of M ranks, read the rows of each target rank this
     process acts for (``shardckpt.virtual``) and keep them as that rank's DTensor shards.
  3) (all) DCP's save protocol for the M target ranks (``formats/dcp_write.py``); or,
     for a local DST, each process saves the file of each target rank it acts for, one
     target rank at a time (``formats/fsdp2_ranks_write.py``).
  4) (rank 0) the full writer closes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardckpt.collect import assemble
from shardckpt.formats import open_full_writer
from shardckpt.formats.base import Reader
from shardckpt.formats.dcp_write import write_dcp
from shardckpt.formats.fsdp1_write import write_fsdp1_local, write_fsdp1_sharded
from shardckpt.formats.fsdp2_ranks_write import write_rank_file
from shardckpt.plan import SKIP, ConvertPlan, dim0_rows, is_sharded, rows_to_read
from shardckpt.staging import Staging
from shardckpt.tree import TensorMeta, map_leaves
from shardckpt.virtual import shard_dtensor, virtual_mesh, virtual_ranks
from shardckpt.writeback import WriteBehind

Progress = Callable[[int], None]


def run(reader: Reader, plan: ConvertPlan, staging: Staging, runtime, progress: Progress) -> None:
    """Write ``plan``'s output under ``staging.tmp`` (opened by the coordinator; see ``Staging``)."""
    if plan.layout == "full":
        _to_full(reader, plan, staging, runtime, progress)
    elif plan.format == "fsdp1-sharded":
        write_fsdp1_sharded(staging.tmp, plan, reader, runtime)
    elif plan.format == "fsdp1-local":
        write_fsdp1_local(staging.tmp, plan, reader, plan.flat_model, plan.use_orig_params, runtime)
    elif plan.layout == "local":
        _to_local(reader, plan, staging, runtime, progress)
    else:
        _to_sharded(reader, plan, staging, runtime, progress)


def _read_batch(
    reader: Reader, batch: list[TensorMeta], runtime, whole_on_coordinator: bool
) -> dict[str, torch.Tensor]:
    """Return this rank's rows of each tensor in ``batch`` it has to read, by key."""
    wanted = [
        (
            m,
            rows_to_read(
                m, runtime.world_size, runtime.rank, whole_on_coordinator=whole_on_coordinator
            ),
        )
        for m in batch
    ]
    wanted = [(m, r) for m, r in wanted if r != SKIP]
    if not wanted:
        return {}
    tensors = reader.read([m for m, _ in wanted], [r for _, r in wanted], runtime)
    return {m.key: t for (m, _), t in zip(wanted, tensors)}


def _to_full(
    reader: Reader, plan: ConvertPlan, staging: Staging, runtime, progress: Progress
) -> None:
    pending = max((sum(m.nbytes for m in b) for b in plan.batches), default=1)
    writer = runtime.agreed(
        lambda: (
            WriteBehind(
                open_full_writer(plan.format, staging.tmp, plan.tree, plan.max_shard_size), pending
            )
            if runtime.coordinator
            else None
        )
    )
    try:
        _gather_and_write(reader, plan, writer, runtime, progress)
    except BaseException:
        if writer is not None:
            writer.abandon()
        raise


def _gather_and_write(
    reader: Reader, plan: ConvertPlan, writer: WriteBehind | None, runtime, progress: Progress
) -> None:
    for batch in plan.batches:
        rows = runtime.agreed(
            lambda b=batch: _read_batch(reader, b, runtime, whole_on_coordinator=True)
        )
        error: BaseException | None = None
        for meta in batch:
            whole = assemble(rows.pop(meta.key, None), meta, runtime, sharded=is_sharded(meta))
            if whole is not None and error is None:
                try:
                    writer.write(meta, whole)
                except Exception as exc:  # noqa: BLE001 - reported to every rank below
                    error = exc
            del whole
        runtime.raise_if_any_failed(error)
        progress(sum(m.nbytes for m in batch))
    runtime.agreed(lambda: writer.close() if writer is not None else None)


def _to_sharded(
    reader: Reader, plan: ConvertPlan, staging: Staging, runtime, progress: Progress
) -> None:
    targets = virtual_ranks(plan.world_size, runtime.rank, runtime.world_size)
    shards: dict[int, dict[str, torch.Tensor]] = {r: {} for r in targets}
    # A tensor every target rank holds whole is read once and shared by their state dicts.
    whole: dict[str, torch.Tensor] = {}

    def read(batch: list[TensorMeta]) -> None:
        if not targets:
            return
        kept = [m for m in batch if m.key in plan.whole]
        if kept:
            whole.update(zip((m.key for m in kept), reader.read(kept, [None] * len(kept), runtime)))
        split = [m for m in batch if m.key not in plan.whole]
        for r in targets if split else ():
            rows = [dim0_rows(m.shape, plan.world_size, r) for m in split]
            shards[r].update(zip((m.key for m in split), reader.read(split, rows, runtime)))

    for batch in plan.batches:
        runtime.agreed(lambda b=batch: read(b))
        progress(sum(m.nbytes for m in batch))

    def state_dict(r: int) -> dict:
        mesh = virtual_mesh(plan.world_size, r)

        def place(_path, leaf):
            if not isinstance(leaf, TensorMeta):
                return leaf
            if leaf.key in plan.whole:
                return whole[leaf.key]
            return shard_dtensor(shards[r].pop(leaf.key), leaf, mesh)

        return map_leaves(plan.tree, place)

    state_dicts = runtime.agreed(lambda: {r: state_dict(r) for r in targets})
    write_dcp(staging.tmp, state_dicts, plan.world_size, runtime)


def _to_local(
    reader: Reader, plan: ConvertPlan, staging: Staging, runtime, progress: Progress
) -> None:
    """Write one file per target rank; a process holds one target rank's shards at a time."""
    targets = virtual_ranks(plan.world_size, runtime.rank, runtime.world_size)
    rounds = -(-plan.world_size // runtime.world_size)
    # Tensors every target rank holds whole are read once and shared by their files.
    whole: dict[str, torch.Tensor] = {}
    for i in range(rounds):
        # Every process runs every round (the agreed steps are collectives), with or
        # without a target rank in it.
        target = targets[i] if i < len(targets) else None
        shards: dict[str, torch.Tensor] = {}

        def read(batch: list[TensorMeta], target=target, shards=shards) -> None:
            if target is None:
                return
            kept = [m for m in batch if m.key in plan.whole and m.key not in whole]
            if kept:
                whole.update(
                    zip((m.key for m in kept), reader.read(kept, [None] * len(kept), runtime))
                )
            split = [m for m in batch if m.key not in plan.whole]
            rows = [dim0_rows(m.shape, plan.world_size, target) for m in split]
            shards.update(zip((m.key for m in split), reader.read(split, rows, runtime)))

        for batch in plan.batches:
            runtime.agreed(lambda b=batch: read(b))
            size = sum(m.nbytes for m in batch)
            progress(size * (i + 1) // rounds - size * i // rounds)
        runtime.agreed(
            lambda target=target, shards=shards: (
                write_rank_file(staging.tmp, plan.tree, plan.world_size, target, shards, whole)
                if target is not None
                else None
            )
        )
