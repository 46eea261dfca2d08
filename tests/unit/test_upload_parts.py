"""The parts a DST file is uploaded in, and which rank sends each (``core.parts``)."""

from __future__ import annotations

import pytest

from shardckpt.core.parts import MOST_PARTS, PART_BYTES, dealt, parts_of

MiB = 1 << 20


def test_a_file_is_cut_in_parts_of_16_mib_growing_every_1000_parts_and_fits_859_gib():
    assert parts_of(40 * MiB) == [(1, 0, 16 * MiB), (2, 16 * MiB, 16 * MiB), (3, 32 * MiB, 8 * MiB)]
    assert parts_of(PART_BYTES) == [(1, 0, PART_BYTES)]
    assert parts_of(0) == []
    big = parts_of(1000 * PART_BYTES + 1)
    assert big[-1] == (1001, 1000 * PART_BYTES, 1)
    most = parts_of(859 << 30)
    assert len(most) <= MOST_PARTS
    assert sum(length for _, _, length in most) == 859 << 30
    assert all(offset + length == nxt for (_, offset, length), (_, nxt, _) in zip(most, most[1:]))


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_each_part_of_all_files_goes_once_to_the_rank_with_the_fewest_bytes(world_size):
    # Two-part files of 16 and 4 MiB: dealt in turn, rank 0 would get every 16 MiB part.
    sizes = {"b-10.bin": 20 * MiB, "b-2.bin": 20 * MiB, "c": 100 * MiB, "d": 20 * MiB}
    shares = [dealt(sizes, rank, world_size) for rank in range(world_size)]
    got = sorted((n, p) for mine in shares for n, parts in mine.items() for p in parts)
    assert got == sorted((n, p) for n in sizes for p in parts_of(sizes[n]))
    sent = [sum(length for parts in mine.values() for _, _, length in parts) for mine in shares]
    assert max(sent) - min(sent) <= PART_BYTES  # the ranks' bytes within one part
    if world_size == 2:  # in natural order: b-2 before b-10, and the ranks through them together
        assert shares[0] == {
            "b-2.bin": [(1, 0, 16 * MiB)],
            "b-10.bin": [(2, 16 * MiB, 4 * MiB)],
            "c": [(n, (n - 1) * 16 * MiB, 16 * MiB) for n in (1, 3, 5)] + [(7, 96 * MiB, 4 * MiB)],
            "d": [(2, 16 * MiB, 4 * MiB)],
        }
