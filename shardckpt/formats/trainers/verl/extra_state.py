"""Which ``extra_state`` file each rank of a veRL output gets: SRC's, copied unread, renamed.

veRL's manager loads ``extra_state_world_size_{M}_rank_{r}.pt`` on every rank r of a job
at M (the lr scheduler's state and the rank's RNG state, pickled numpy objects that are
never unpickled here). Rank r gets SRC's rank r file, byte for byte, renamed for M; a
rank SRC's job did not have gets rank 0's (the scheduler is the same on every rank; the
RNG state is then rank 0's), and the output says so; a SRC without them (not veRL's)
gets a note on how to load DST without them.
"""

from __future__ import annotations

from pathlib import Path

from shardckpt.core.words import counted
from shardckpt.formats.trainers.verl.names import EXTRA, file_name, parse


def extra_state_copies(
    src: Path, carried: list[str], world_size: int
) -> tuple[list[tuple[Path, str]], str | None]:
    """Return ``(SRC file, DST name)`` for every rank of ``world_size``, and the note to say, if any."""
    ranks = {r: n for n in carried if (p := parse(n)) is not None and p[0] == EXTRA for r in [p[2]]}
    if not ranks:
        return [], (
            "SRC has no extra_state files (lr scheduler and RNG state), which veRL's manager "
            "loads on every rank: load DST with checkpoint.load_contents=['model', 'optimizer']"
        )
    copies = [
        (src / ranks.get(r, ranks[min(ranks)]), file_name(EXTRA, world_size, r))
        for r in range(world_size)
    ]
    borrowed = [r for r in range(world_size) if r not in ranks]
    dropped = sorted(r for r in ranks if r >= world_size)
    said = []
    if borrowed:
        which = ", ".join(map(str, borrowed))
        said.append(
            f"{counted(len(borrowed), 'rank')} of {world_size} ({which}) had none in SRC and get "
            f"rank {min(ranks)}'s extra_state (its lr scheduler, and its RNG state)"
        )
    if dropped:
        said.append(
            f"the extra_state of SRC's {counted(len(dropped), 'rank')} "
            f"{', '.join(map(str, dropped))} is not in DST (a job of {world_size} has no such rank)"
        )
    return copies, "; ".join(said) or None
