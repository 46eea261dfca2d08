"""Where DST lies for each rank: one filesystem every rank sees, or the nodes' own disks.

The coordinator opens DST (``destination.py``: lock, staging path) and writes its run's
token into the lock file. Every rank then looks for that lock file: the ranks that read
the token share the coordinator's filesystem. If some do not (each node of a multi-node
launch writing to its own disk), the lowest of them opens DST on its filesystem in the
same way, and so on, until every rank has a filesystem; each opener commits its copy.

On one filesystem real rank k of N acts for target ranks k, k + N, k + 2N, ... On
several, the target ranks of M are cut into one block per filesystem, in order
(torchrun numbers a node's ranks contiguously, so a job at M on as many nodes puts
block g on node g), and each block is shared round-robin by the ranks that see it.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardckpt.core.destination import Destination
from shardckpt.core.errors import UsageError


@dataclass(frozen=True)
class Placement:
    """The ranks that see each copy of DST (the coordinator's first), from one rank's side."""

    groups: tuple[tuple[int, ...], ...]
    rank: int

    @property
    def several(self) -> bool:
        """Return whether the ranks write to more than one filesystem."""
        return len(self.groups) > 1

    @property
    def group(self) -> tuple[int, ...]:
        """Return the ranks that see the same DST as this rank."""
        return self.groups[self._index]

    @property
    def opener(self) -> bool:
        """Return whether this rank opens, commits and closes its filesystem's DST."""
        return self.rank == self.group[0]

    @property
    def _index(self) -> int:
        return next(i for i, g in enumerate(self.groups) if self.rank in g)

    def targets(self, world_size: int) -> list[int]:
        """Return the target ranks of ``world_size`` whose files this rank writes."""
        start, stop = self.block(self._index, world_size)
        members = self.group
        return list(range(start + members.index(self.rank), stop, len(members)))

    def block(self, index: int, world_size: int) -> tuple[int, int]:
        """Return the target ranks [start, stop) written to the DST of group ``index``.

        Rounded up, so that the coordinator's group writes target rank 0 (DCP's planner).
        """
        count = len(self.groups)
        return -(-index * world_size // count), -(-(index + 1) * world_size // count)

    def describe(self, world_size: int) -> str:
        """Return one line saying which target ranks' files each disk holds."""
        parts = []
        for i, group in enumerate(self.groups):
            start, stop = self.block(i, world_size)
            who = "rank" if len(group) == 1 else "ranks"
            held = _span(start, stop - 1) if stop > start else "none"
            parts.append(f"{who} {_span(group[0], group[-1], group)}'s disk {held}")
        return (
            f"DST is on {len(self.groups)} disks the ranks do not share, so each holds a block "
            f"of target ranks: {', '.join(parts)} (where a job at {world_size} on as many "
            "nodes runs them)"
        )


def _span(first: int, last: int, members: tuple[int, ...] | None = None) -> str:
    if members is not None and list(members) != list(range(first, last + 1)):
        return ",".join(map(str, members))
    return str(first) if first == last else f"{first}-{last}"


def shared(rank: int = 0, world_size: int = 1) -> Placement:
    """Return the placement of a DST every one of ``world_size`` ranks sees."""
    return Placement((tuple(range(world_size)),), rank)


def open_destination(destination: Destination, runtime) -> Placement:
    """Open DST on every filesystem the ranks write to; return this rank's ``Placement``.

    Every rank calls it; each step is agreed, so a failure to open anywhere stops all.
    """
    if not runtime.distributed:
        runtime.agreed(destination.open)
        return shared()
    groups: list[tuple[int, ...]] = []
    left = set(range(runtime.world_size))
    while left:
        opener = min(left)
        runtime.agreed(lambda o=opener: destination.open() if runtime.rank == o else None)
        run = runtime.broadcast(destination.run if runtime.rank == opener else None, src=opener)
        mine = runtime.rank in left
        sees = runtime.agreed(lambda r=run, m=mine: m and destination.sees(r))
        group = tuple(r for r, yes in enumerate(runtime.all_gather(sees)) if yes)
        if opener not in group:
            raise UsageError(
                "DST's lock file cannot be read back by the rank that wrote it",
                path=destination.dst,
                hint="write DST to a local or network filesystem that keeps what is written",
            )
        groups.append(group)
        left -= set(group)
    return Placement(tuple(groups), runtime.rank)
