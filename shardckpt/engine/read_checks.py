"""The checksums of what every rank read, judged on the coordinator once a command's reads are done.

Each rank's ledger (``state.checksums``) holds the spans it read of each record; the
coordinator chains them per record and compares (``judge``), and every rank gets the
same verdict, so a damaged record stops every rank with one line.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from shardckpt.core.errors import BadInputError, ShardckptError
from shardckpt.state.checksums import Damage, Verdict, active, judge

RECOPY = "the file was damaged after it was written; re-copy it"


def within(root: str | Path) -> Callable[[str], bool]:
    """Return a test of whether a file is ``root`` or lies under it."""
    top = Path(root)

    def test(file: str) -> bool:
        path = Path(file)
        return path == top or top in path.parents

    return test


def judged(runtime, where: Callable[[str], bool] | None = None) -> Verdict | None:
    """Return the verdict on every span read of the files ``where`` admits, the same on every rank.

    None when no ledger is active (``SHARDCKPT_CHECKSUMS=0``). A collective: every rank calls it.
    """
    ledger = active()
    if ledger is None:
        return None
    seen = [s for s in ledger.seen() if where is None or where(s.written.file)]
    gathered = runtime.gather(seen)
    return runtime.broadcast(judge(gathered) if runtime.coordinator else None)


def damage_error(
    damaged: tuple[Damage, ...], make: type[ShardckptError] = BadInputError, hint: str = RECOPY
) -> ShardckptError:
    """Return the one-line error naming the first damaged record (file, tensor, record) and how many more."""
    first = damaged[0]
    message = first.message()
    if len(damaged) > 1:
        message += f"; {len(damaged) - 1} more damaged (`shardckpt verify` lists them)"
    return make(message, path=first.written.file, hint=hint)


def check_reads(runtime, root: str | Path) -> None:
    """Raise, on every rank, for a damaged record of a file under ``root`` that was read whole."""
    verdict = judged(runtime, within(root))
    if verdict is not None and verdict.damaged:
        raise damage_error(verdict.damaged)
