"""How many ranks a sharded or local DST is written for: the bounds on ``--world-size`` and why.

Each of the M target ranks is planned and laid out in memory on its own: its DTensors,
DCP's save plan for it, its files (see ``target_ranks``). So time and memory grow with
M times the leaves each rank holds (measured on torch 2.13, CPU: 1 to 3 ms and about
3.5 KiB per rank and leaf for ``dcp``, 0.6 KiB for ``fsdp2-ranks``), and per-rank files
also describe all M ranks each (a DTensor's mesh, a ShardedTensor's shard list), so a
local DST grows with M². Rather than run for hours and end out of memory, a world size
past these bounds is refused before any rank is planned (exit 2):

- ``MAX_WORLD_SIZE`` ranks at most, whatever SRC;
- past ``ANY_CHECKPOINT_RANKS``, no more ranks than any tensor is split over (its rows;
  FSDP1's flat parameters: elements): every rank past those would hold no part of any;
- ``MAX_RANK_ENTRIES`` leaves over all ranks (M times the tensors and values one holds).
"""

from __future__ import annotations

from shardckpt.core.errors import UsageError

MAX_WORLD_SIZE = 65536
"""The most ranks a DST is written for."""

ANY_CHECKPOINT_RANKS = 1024
"""Up to this many ranks, any checkpoint is written for, however small its tensors."""

MAX_RANK_ENTRIES = 1 << 22
"""The most leaves (tensors and values) over all target ranks: 1024 ranks of 4096 leaves (a
70B Llama with Adam's state has about 2900), at most about 14 GiB for ``dcp``."""

_LOADS_ANYWHERE = "a DCP checkpoint, --to sharded, loads at any world size: dcp.load reshards it"


def check_world_size(world_size: int) -> None:
    """Refuse a ``--world-size`` past ``MAX_WORLD_SIZE``, before SRC is read."""
    if world_size > MAX_WORLD_SIZE:
        raise UsageError(
            f"--world-size {world_size} is more than {MAX_WORLD_SIZE}, the most ranks shardckpt "
            "writes a checkpoint for: every rank's files are planned and written one by one",
            hint=f"pass the number of ranks that will load DST ({_LOADS_ANYWHERE})",
        )


def check_rank_work(world_size: int, parts: int, what: str, leaves: int) -> None:
    """Refuse a world size out of proportion with what each rank would hold.

    ``parts``: the most ranks any tensor of the plan is split over (rows, or elements
    for FSDP1's flat parameters), which ``what`` says (``SRC's tensors have at most 24
    rows``); ``leaves``: the tensors and values each rank holds.
    """
    most = max(parts, ANY_CHECKPOINT_RANKS)
    if world_size > most:
        raise UsageError(
            f"--world-size {world_size} is more than {ANY_CHECKPOINT_RANKS} ranks, and {what}: "
            f"every rank past the first {parts} would hold no part of any split tensor",
            hint=f"pass --world-size {most} or less, the ranks that will load DST "
            f"({_LOADS_ANYWHERE})",
        )
    if world_size * leaves > MAX_RANK_ENTRIES:
        raise UsageError(
            f"--world-size {world_size} puts {leaves} tensors and values on each rank, "
            f"{world_size * leaves} in all, more than the {MAX_RANK_ENTRIES} shardckpt lays "
            "out in memory at once",
            hint=f"pass --world-size {max(MAX_RANK_ENTRIES // leaves, 1)} or less, or select "
            "fewer tensors (--only, --filter)",
        )
