"""The parts a DST file is uploaded in (S3's multipart uploads), and which process sends each.

A file is cut in parts of ``part_size`` (16 MiB, growing every 1,000 parts, so a file of
up to 860 GiB fits S3's 10,000 parts); a file of at most ``PART_BYTES`` is one PUT. A
file every rank filled is sent by every rank: its parts are ``dealt`` among them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

PART_BYTES = 16 << 20
"""The size of an upload's parts (S3: at least 5 MiB but the last); a file up to this size is one PUT."""
MOST_PARTS = 10_000
"""S3's limit of parts per upload."""

Part = tuple[int, int, int]
"""A part of a file: its number (from 1), its offset in the file and its length."""


def part_size(number: int) -> int:
    """Return the size of part ``number`` (from 1): 16 MiB, 16 MiB more every 1,000 parts.

    S3 takes 10,000 parts of an upload: so a file of up to 860 GiB, written before its size
    is known, fits.
    """
    return PART_BYTES * (1 + (number - 1) // 1000)


def parts_of(size: int) -> list[Part]:
    """Return the parts a file of ``size`` bytes is uploaded in, in order (``part_size`` each, the last shorter)."""
    parts: list[Part] = []
    offset = 0
    while offset < size:
        number = len(parts) + 1
        length = min(size - offset, part_size(number))
        parts.append((number, offset, length))
        offset += length
    return parts


def natural(name: str) -> list:
    """Return the key that sorts names as a person reads them (``__2_0`` before ``__10_0``)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def dealt(sizes: Mapping[str, int], rank: int, world_size: int) -> dict[str, list[Part]]:
    """Return the parts of the files ``sizes`` (name: bytes) that rank ``rank`` of ``world_size`` sends.

    The parts of every file, file after file in natural name order, each to the rank that
    has the fewest bytes so far (the lowest such rank): the ranks' bytes differ by one part
    at most, whatever the files' sizes (dealt in turn, part p to rank p mod N, two-part
    files of 16 MiB and 4 MiB would give every 16 MiB part to rank 0), and they move
    through the files together. Runs of consecutive parts would buy a rank nothing: each
    part is a sequential read of 16 MiB or more.
    """
    mine: dict[str, list[Part]] = {}
    load = [0] * world_size
    for name in sorted(sizes, key=natural):
        for part in parts_of(sizes[name]):
            least = load.index(min(load))
            load[least] += part[2]
            if least == rank:
                mine.setdefault(name, []).append(part)
    return mine
