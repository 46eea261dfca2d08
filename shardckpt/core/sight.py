"""Which ranks see which of SRC's files: sources that are not on one shared filesystem.

Multi-node jobs often save to node-local disks, so each node holds only its own ranks'
files (and the coordinator's node DCP's ``.metadata``). Under ``torchrun`` every rank
lists the files it sees under SRC, and the lists are shared (``look``). Where every rank
sees every file nothing changes. Otherwise (or with ``--src-local``) a reader reads
only files its rank sees: what is read once for all (metadata, plain values) is read
by one rank that sees it and broadcast (``Sight.shared``), and tensor rows move to the
rank that needs them over the collective (``shardckpt.engine.exchange``).

Call order (all ranks): ``look(src, runtime)``; then the reader's calls of
``Sight.shared``, each made by every rank in the same order.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from shardckpt.core.errors import BadInputError

T = TypeVar("T")

COPY_HINT = "copy it to a node of the job, or run where every file of SRC can be seen"


@dataclass(frozen=True)
class Sight:
    """The files of SRC (relative paths; ``""`` for a one-file SRC), who sees each, and its size."""

    src: Path
    runtime: object
    seen_by: Mapping[str, frozenset[int]]
    sizes: Mapping[str, int]

    @property
    def complete(self) -> bool:
        """Return whether every rank sees every file."""
        everyone = frozenset(range(self.runtime.world_size))  # type: ignore[attr-defined]
        return all(ranks == everyone for ranks in self.seen_by.values())

    def sees(self, rank: int, files: Iterable[str]) -> bool:
        """Return whether rank ``rank`` sees every one of ``files``."""
        return all(rank in self.seen_by.get(f, ()) for f in files)

    def readers(self, files: Iterable[str]) -> list[int]:
        """Return the ranks that see every one of ``files``, lowest first."""
        files = list(files)
        return [r for r in range(self.runtime.world_size) if self.sees(r, files)]  # type: ignore[attr-defined]

    def files_of(self, rank: int) -> list[str]:
        """Return the files rank ``rank`` sees."""
        return sorted(f for f, ranks in self.seen_by.items() if rank in ranks)

    def most_seeing(self) -> int:
        """Return the rank that sees the most files (the lowest of those that tie)."""
        counts = [0] * self.runtime.world_size  # type: ignore[attr-defined]
        for ranks in self.seen_by.values():
            for r in ranks:
                counts[r] += 1
        return counts.index(max(counts))

    def unseen(self, files: Iterable[str]) -> BadInputError:
        """Return the error for ``files`` that no one rank sees."""
        files = sorted(files)
        missing = [f for f in files if not self.seen_by.get(f)]
        if missing:
            return BadInputError(
                "no rank of the job sees it", path=self.src / missing[0], hint=COPY_HINT
            )
        where = "; ".join(f"'{f}' on ranks {_ranks(self.seen_by[f])}" for f in files)
        return BadInputError(
            f"no one rank sees all of {where}, which are read together",
            path=self.src,
            hint="keep the files of one tensor's rows on one node",
        )

    def shared(self, files: Iterable[str], fn: Callable[[], T]) -> T:
        """Return ``fn()``, run by the lowest rank that sees ``files`` and broadcast to every rank."""
        files = list(files)
        readers = self.readers(files)
        if not readers:
            raise self.unseen(files)
        runtime = self.runtime
        mine = runtime.rank == readers[0]  # type: ignore[attr-defined]
        value = runtime.agreed(lambda: fn() if mine else None)  # type: ignore[attr-defined]
        return runtime.broadcast(value, src=readers[0])  # type: ignore[attr-defined]


def _ranks(ranks: Iterable[int]) -> str:
    return ", ".join(map(str, sorted(ranks)))


def listing(src: Path) -> dict[str, int]:
    """Return the regular files this process sees under ``src`` (relative POSIX paths) and their sizes.

    A link is followed only to a file inside ``src``: the readers refuse the others,
    and a file this rank cannot use is one it does not see.
    """
    try:
        st = os.stat(src)
    except OSError:
        return {}
    if stat.S_ISREG(st.st_mode):
        return {"": st.st_size}
    if not stat.S_ISDIR(st.st_mode):
        return {}
    root = os.path.realpath(src)
    out: dict[str, int] = {}
    for here, dirs, names in os.walk(src):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(here, name)
            real = os.path.realpath(path)
            try:
                st = os.stat(path)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and os.path.commonpath([real, root]) == root:
                out[Path(os.path.relpath(path, src)).as_posix()] = st.st_size
    return out


def look(src: str | os.PathLike, runtime) -> Sight:
    """Return who sees which of SRC's files, from every rank's ``listing`` (a collective)."""
    src = Path(src)
    mine = runtime.agreed(lambda: listing(src))
    seen_by: dict[str, set[int]] = {}
    sizes: dict[str, tuple[int, int]] = {}
    for rank, files in enumerate(runtime.all_gather(mine)):
        for name, size in files.items():
            seen_by.setdefault(name, set()).add(rank)
            first = sizes.setdefault(name, (rank, size))
            if first[1] != size:
                raise BadInputError(
                    f"is {first[1]} bytes on rank {first[0]} but {size} on rank {rank}",
                    path=src / name if name else src,
                    hint="the ranks' copies of SRC differ; copy it again from where the job saved it",
                )
    return Sight(
        src,
        runtime,
        {name: frozenset(r) for name, r in seen_by.items()},
        {name: size for name, (_, size) in sizes.items()},
    )


__all__ = ["Sight", "listing", "look"]
