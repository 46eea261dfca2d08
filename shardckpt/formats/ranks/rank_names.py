"""Per-rank file names of every local format: the name shardckpt writes, the names it reads.

shardckpt writes ``rank_{r}.pt`` for every local format (``fsdp2-ranks``,
``fsdp1-sharded``, ``fsdp1-local``). The underscore is veRL's spelling
(``model_world_size_4_rank_3.pt``) and FSDP1 jobs' usual one, it keeps the rank apart
from the word for a glob (``rank_*.pt``), and one spelling for all local outputs means a
script that loads ``f"rank_{rank}.pt"`` works whichever format it asked for.

A directory holds one file per rank. Read are, with any of ``.pt``, ``.pth``, ``.bin``:
``rank3.pt``, ``rank_3.pt``, ``rank-3.pt``, ``model_rank3.pt``, ``rank3-of-4.pt``, DCP's
own ``__3_0.pt``, veRL's ``model_world_size_4_rank_3.pt`` and accelerate's
``pytorch_model_fsdp_rank3.bin``. What stays of a name without its rank and world size
is its *part*: veRL saves ``model_…``, ``optim_…`` and ``extra_state_…`` per rank, three
parts, each one tree; ``rank3.pt`` is the only part, ``""``.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from pathlib import Path

from shardckpt.core.errors import BadInputError
from shardckpt.core.files import check_separate, has_file

_RANK_NAME = re.compile(
    r"^(?P<stem>.*?)rank[_-]?(?P<rank>\d+)(?:[_-]of[_-](?P<of>\d+))?\.(?:pt|pth|bin)$"
)
_DCP_NAME = re.compile(r"^__(?P<rank>\d+)_0\.(?:pt|pth|bin)$")
_WORLD_SIZE = re.compile(r"world[_-]?size[_-]?(?P<ws>\d+)")


def rank_file_name(rank: int) -> str:
    """Return the name shardckpt gives rank ``rank``'s file in every local format: ``rank_{rank}.pt``."""
    return f"rank_{rank}.pt"


EXAMPLE = f"{rank_file_name(0)}, {rank_file_name(1)}, …"
"""The names of the first files of a directory shardckpt writes, for hints."""


@dataclass(frozen=True)
class RankName:
    """What a per-rank file's name says: its part, its rank, and the job's world size if named."""

    part: str
    rank: int
    world_size: int | None


def parse_rank_name(name: str) -> RankName | None:
    """Return what a per-rank file name says, or None for any other name."""
    m = _DCP_NAME.match(name)
    if m:
        return RankName("", int(m.group("rank")), None)
    m = _RANK_NAME.match(name)
    if not m:
        return None
    stem = m.group("stem")
    named = _WORLD_SIZE.search(stem)
    ws = m.group("of") or (named.group("ws") if named else None)
    part = _WORLD_SIZE.sub("", stem).strip("_-.")
    return RankName(part, int(m.group("rank")), int(ws) if ws else None)


def find_rank_files(directory: Path) -> dict[str, dict[int, Path]]:
    """Return ``{part: {rank: file}}`` for the per-rank files in ``directory`` (``{}`` if none)."""
    parts: dict[str, dict[int, Path]] = {}
    for path in sorted(directory.iterdir()):
        found = parse_rank_name(path.name)
        # A rank's name on a directory, a FIFO or a link out of SRC is refused, not skipped.
        if found is None or not has_file(path, directory):
            continue
        files = parts.setdefault(found.part, {})
        if found.rank in files:
            raise BadInputError(
                f"two files for rank {found.rank}: '{files[found.rank].name}' and '{path.name}'",
                path=directory,
                hint="keep one file per rank in the directory",
            )
        files[found.rank] = path
    return parts


def rank_files(src: Path) -> dict[str, dict[int, Path]]:
    """Return ``{part: {rank: file}}`` of ``src``, ranks ``0 … N-1`` in order, checked complete."""
    parts = present_rank_files(src)
    world_size = check_complete(src, parts)
    return {part: {r: files[r] for r in range(world_size)} for part, files in parts.items()}


def present_rank_files(src: Path) -> dict[str, dict[int, Path]]:
    """Return ``{part: {rank: file}}`` of the per-rank files in ``src``, not yet checked complete.

    A reader that learns the job's world size from the files' contents checks them
    against it (``check_complete``); the names alone miss a missing last rank. Two names
    of one file (a link) are refused here, before any is loaded (``check_separate``).
    """
    if not src.is_dir():
        raise BadInputError(
            "is not a directory of per-rank files",
            path=src,
            hint=f"pass the directory holding {EXAMPLE}",
        )
    parts = find_rank_files(src)
    if not parts:
        raise BadInputError(
            "holds no per-rank files",
            path=src,
            hint=f"name them like {rank_file_name(0)} (or STEM_rank_R.pt, STEM_world_size_N_rank_R.pt)",
        )
    check_separate(
        {(part, rank): path for part, files in parts.items() for rank, path in files.items()},
        _whose,
    )
    return {part: dict(sorted(files.items())) for part, files in parts.items()}


def _whose(key: tuple[str, int]) -> str:
    part, rank = key
    return f"rank {rank}'s file" + (f" of '{part}'" if part else "")


def check_complete(
    src: Path, parts: dict[str, dict[int, Path]], world_size: int | None = None
) -> int:
    """Return the world size of ``parts``: ``world_size`` if given, else what the names say.

    Every part must have a file for every rank below it. A world size in the names is the
    job's; otherwise the highest rank tells it, so a missing last rank is found only by a
    reader that knows the job's world size from the files' contents.
    """
    if world_size is None:
        world_size = _named_world_size(src, parts)
    for files in parts.values():
        # The world size comes from names or pickles (10**12 is a few bytes there): the
        # first rank without a file is at most the count of files, never found by
        # walking every rank below world_size.
        missing = next(r for r in itertools.count() if r not in files)
        if missing < world_size:
            name = _name_like(next(iter(files.values())).name, missing)
            raise BadInputError(
                f"no file for rank {missing} of {world_size} ({name})",
                path=src,
                hint="copy every rank's file of the checkpoint",
            )
    return world_size


def _named_world_size(src: Path, parts: dict[str, dict[int, Path]]) -> int:
    """Return the world size the names of ``parts`` say; refuse names of several."""
    names = [parse_rank_name(p.name) for files in parts.values() for p in files.values()]
    named = {n.world_size for n in names if n and n.world_size}
    top = max(max(files) for files in parts.values()) + 1
    sizes = named | ({top} if not named or top > max(named) else set())
    if len(sizes) > 1:
        raise BadInputError(
            f"holds files of different world sizes ({', '.join(map(str, sorted(sizes)))})",
            path=src,
            hint="keep only one checkpoint's rank files in the directory",
        )
    return sizes.pop()


def _name_like(name: str, rank: int) -> str:
    """Return the file name rank ``rank`` would have, following ``name``."""
    m = _DCP_NAME.match(name) or _RANK_NAME.match(name)
    assert m is not None
    start, end = m.span("rank")
    return name[:start] + str(rank) + name[end:]


def is_rank_dir(path: Path) -> bool:
    """Return whether ``path`` is a directory holding per-rank files."""
    return path.is_dir() and bool(find_rank_files(path))
