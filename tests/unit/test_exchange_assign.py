"""Who reads and sends each piece of the ranks' rows when they see different files (pure)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from shardckpt.core.dist import Runtime
from shardckpt.core.errors import BadInputError
from shardckpt.core.sight import Sight, listing
from shardckpt.engine.exchange import assign
from shardckpt.state.tree import TensorMeta

# A 10 x 4 fp32 tensor stored as rows 0-4 in "a" and rows 5-9 in "b" (16 bytes a row).
META = {"w": TensorMeta("w", (10, 4), torch.float32)}


def files_for(meta, rows):
    start, stop = rows
    parts = []
    for lo, hi, name in ((0, 5, "a"), (5, 10, "b")):
        if max(start, lo) < min(stop, hi):
            parts.append(((max(start, lo), min(stop, hi)), frozenset({name})))
    return parts


def sight(seen_by: dict[str, set[int]], world_size: int = 3) -> Sight:
    return Sight(
        Path("src"),
        Runtime(world_size=world_size),
        {f: frozenset(r) for f, r in seen_by.items()},
        dict.fromkeys(seen_by, 80),
    )


def test_a_rank_reads_the_rows_it_sees_itself_and_gets_the_others_from_a_rank_that_sees_them():
    pieces = assign(
        [[("w", (3, 8))], [], []], META, files_for, sight({"a": {0}, "b": {1, 2}}), 1 << 20
    )
    assert [(p.rows, p.sender, p.at, p.nbytes) for p in pieces] == [
        ((3, 5), 0, 0, 32),
        ((5, 8), 1, 32, 48),
    ]


def test_senders_are_balanced_by_bytes_and_a_senders_rounds_stay_under_the_limit():
    asks = [[("w", (5, 10))], [("w", (5, 10))], []]
    pieces = assign(asks, META, files_for, sight({"a": {0, 1}, "b": {2}}), 100)
    assert [(p.asker, p.sender, p.round) for p in pieces] == [(0, 2, 0), (1, 2, 1)]
    balanced = assign(asks, META, files_for, sight({"a": {0, 1}, "b": {2, 0, 1}}), 100)
    assert [(p.asker, p.sender) for p in balanced] == [(0, 0), (1, 1)]
    two = assign(
        [[], [], [("w", (5, 10))], [("w", (5, 10))]],
        META,
        files_for,
        sight({"a": {0}, "b": {0, 1}}, world_size=4),
        1 << 20,
    )
    assert [p.sender for p in two] == [0, 1]


def test_rows_no_rank_sees_are_refused_naming_the_file():
    with pytest.raises(BadInputError, match="no rank of the job sees it"):
        assign([[("w", (0, 10))], [], []], META, files_for, sight({"a": {0}}), 1 << 20)


def test_a_listing_holds_regular_files_inside_src_only(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.distcp").write_bytes(b"12345")
    (src / "sub" / "b").write_bytes(b"1")
    (tmp_path / "outside").write_bytes(b"xx")
    (src / "link-out").symlink_to(tmp_path / "outside")
    (src / "link-in").symlink_to(src / "a.distcp")

    os.mkfifo(src / "fifo")
    assert listing(src) == {"a.distcp": 5, "link-in": 5, "sub/b": 1}
    assert listing(src / "a.distcp") == {"": 5}
    assert listing(tmp_path / "missing") == {}
