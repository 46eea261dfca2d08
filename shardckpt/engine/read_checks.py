"""The checksums of what every rank read, judged on the coordinator once a command's reads are done.

Each rank's ledger (``state.checksums``) holds the spans it read of each record; the
coordinator chains them per record, reads what little the ranks left out of a record
(``completed``), compares (``judge``), and every rank gets the same verdict, so a
damaged record stops every rank with one line.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from shardckpt.core.errors import BadInputError, ShardckptError
from shardckpt.core.files import pread
from shardckpt.state.checksums import (
    Damage,
    Seen,
    Verdict,
    Written,
    active,
    merged,
    next_gap,
    verdict,
)
from shardckpt.state.regions import crc32

RECOPY = "the file was damaged after it was written; re-copy it"
COMPLETE_BYTES = 1 << 20
"""Bytes of a record the coordinator reads itself, at least, to complete what the ranks read."""


def within(root: str | Path) -> Callable[[str], bool]:
    """Return a test of whether a file is ``root`` or lies under it."""
    top = Path(root)
    known: dict[str, bool] = {}  # by file: a checkpoint's records lie in few files

    def test(file: str) -> bool:
        if file not in known:
            path = Path(file)
            known[file] = path == top or top in path.parents
        return known[file]

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
    return runtime.broadcast(verdict(completed(gathered)) if runtime.coordinator else None)


def completed(gathered: list[list[Seen]]) -> list[Seen]:
    """Return what every rank read, each record's missing bytes read here when they are few.

    A record whose reads leave out a little (FSDP1's and FSDP2's padded shards: the tensor
    views its rows, ``torch.save`` saved the padding too) is completed from its file, at
    most ``max(COMPLETE_BYTES, its length / 8)``; one read mostly in part is left unjudged.
    """
    out = []
    for seen in merged(gathered):
        spans, length = list(seen.spans), seen.written.length
        if len(spans) == 1 and spans[0][:2] == (0, length):  # read whole, in one piece
            out.append(seen)
            continue
        budget = max(COMPLETE_BYTES, length // 8)
        while (gap := next_gap(spans, length)) is not None and gap[1] - gap[0] <= budget:
            crc = _crc_of(seen.written, *gap)
            if crc is None:
                break
            spans.append((gap[0], gap[1] - gap[0], crc))
            budget -= gap[1] - gap[0]
        out.append(Seen(seen.written, seen.names, tuple(spans)))
    return out


def _crc_of(written: Written, start: int, stop: int) -> int | None:
    """Return the CRC-32 of bytes [start, stop) of a written span, read from its file; None if unreadable here."""
    try:
        fd = os.open(written.file, os.O_RDONLY)
    except OSError:
        return None  # a file only other ranks see (node-local disks): left unjudged
    try:
        data = pread(fd, stop - start, written.start + start)  # a URL SRC's from the store
    except OSError:
        return None
    finally:
        os.close(fd)
    return crc32(data) if len(data) == stop - start else None


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
    found = judged(runtime, within(root))
    if found is not None and found.damaged:
        raise damage_error(found.damaged)
