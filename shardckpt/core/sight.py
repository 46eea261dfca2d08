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

Ranks that each read a file for themselves must read the same bytes: a node's copy of
SRC of the same size but other content would plan DST from other metadata there, and a
DST would mix both. The sizes are compared by ``look``; the metadata each rank read (every
pickle a reader checks, DCP's ``.metadata`` and each ``torch.save`` file's among them) is
noted by file with its BLAKE2b digest (``note_metadata``, inside ``noting_metadata``) and
the digests compared before any data moves (``agree_on_metadata``). Tensor data files are
trusted to be the same bytes where their sizes agree: digesting them would read them twice.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextvars import ContextVar
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


_METADATA: ContextVar[dict[str, set[bytes]] | None] = ContextVar("shardckpt_metadata", default=None)


@contextlib.contextmanager
def noting_metadata() -> Iterator[None]:
    """Note the metadata this process reads inside (``note_metadata``), for ``agree_on_metadata``."""
    if _METADATA.get() is not None:  # a command inside another: the outer one notes
        yield
        return
    token = _METADATA.set({})
    try:
        yield
    finally:
        _METADATA.reset(token)


def note_metadata(path: str | os.PathLike, digest: bytes) -> None:
    """Note that this process read metadata of BLAKE2b ``digest`` from file ``path``."""
    noted = _METADATA.get()
    if noted is not None:
        noted.setdefault(os.path.abspath(path), set()).add(digest)


def agree_on_metadata(runtime, src: str | os.PathLike) -> None:
    """Raise, the same error on every rank, when two ranks read other metadata from one file of ``src``.

    Every rank calls it, in step, once each read SRC's metadata (a collective). Only files
    inside ``src`` are compared: an existing DST read for ``--overwrite`` may differ by node.
    """
    if not runtime.distributed:
        return
    root = os.path.abspath(src)
    noted = _METADATA.get() or {}
    mine = {
        path: sorted(digests)
        for path, digests in noted.items()
        if path == root or path.startswith(root + os.sep)
    }
    first: dict[str, tuple[int, list[bytes]]] = {}
    for rank, seen in enumerate(runtime.all_gather(mine)):
        for path in sorted(seen):
            other = first.setdefault(path, (rank, seen[path]))
            if other[1] != seen[path]:
                error = BadInputError(
                    f"holds other metadata on rank {rank} than on rank {other[0]}, which "
                    "read another copy of it: a DST planned from both would mix them",
                    path=path,
                    hint="the ranks' copies of SRC differ; copy it again from where the job "
                    "saved it",
                )
                error.everywhere = True  # every rank raises it; rank 0 reports it
                raise error


__all__ = ["Sight", "agree_on_metadata", "listing", "look", "note_metadata", "noting_metadata"]
