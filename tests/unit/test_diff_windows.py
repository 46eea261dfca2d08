"""``diff`` reads both sides in windows of rows, side by side: what it finds is the same at any buffer.

The checkpoints are written by torch's own ``dcp.save``; a buffer of 1 KiB cuts the
97x48 tensor into one-row windows, 4 KiB into a few rows each, 256 MiB reads it whole.
"""

from __future__ import annotations

import json
from pathlib import Path

import damage
import pytest
import torch
import torch.distributed.checkpoint as dcp

from shardckpt.cli.app import run
from shardckpt.engine.side_by_side import pieces
from shardckpt.state.tree import TensorMeta

BUFFERS = ["1KiB", "4KiB", "256MiB"]


def state() -> dict[str, torch.Tensor]:
    """Return the tensors both sides start from: uneven rows, a vector, a scalar, an empty one."""
    gen = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(97, 48, generator=gen),
        "b": torch.randn(48, generator=gen),
        "step": torch.tensor(3.0),
        "e": torch.empty(0, 4),
    }


@pytest.fixture
def sides(tmp_path) -> tuple[Path, Path, float]:
    """Return A, B (A with one element of ``w``'s last rows changed) and |a - b| there."""
    a, b = state(), state()
    b["w"][90, 7] += 0.5
    dcp.save(a, checkpoint_id=tmp_path / "a", no_dist=True)
    dcp.save(b, checkpoint_id=tmp_path / "b", no_dist=True)
    delta = abs(float(b["w"][90, 7].double() - a["w"][90, 7].double()))
    return tmp_path / "a", tmp_path / "b", delta


def diff_json(capsys, *argv) -> tuple[int, dict]:
    code = run(["diff", *map(str, argv), "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("buffer", BUFFERS)
def test_a_value_changed_in_a_late_window_is_found_at_any_buffer(capsys, sides, buffer):
    a, b, delta = sides
    code, doc = diff_json(capsys, a, b, "--buffer-size", buffer)
    assert code == 1
    assert doc["differences"] == [{"path": ["w"], "reason": "values differ", "max_abs_diff": delta}]


@pytest.mark.parametrize("buffer", BUFFERS)
def test_within_tolerance_and_against_itself_diff_is_equal_at_any_buffer(capsys, sides, buffer):
    a, b, _ = sides
    assert diff_json(capsys, a, b, "--buffer-size", buffer, "--atol", "0.6")[0] == 0
    assert diff_json(capsys, a, a, "--buffer-size", buffer)[0] == 0


@pytest.mark.parametrize("buffer", ["1KiB", "256MiB"])
def test_a_flipped_byte_read_in_windows_is_damage_not_a_difference(capsys, sides, tmp_path, buffer):
    a, _, _ = sides
    flipped_dir = damage.copy(a, tmp_path / "flipped")
    flipped = damage.flip_in_dcp(flipped_dir, "w")
    for argv in ((a, flipped_dir), (flipped_dir, flipped_dir)):
        # The same damage on both sides is no "equal": the bytes do not match their CRC.
        code = run(["diff", *map(str, argv), "--buffer-size", buffer, "-q"])
        assert (code, capsys.readouterr().err.strip().splitlines()) == (3, [flipped.line()])


def test_buffer_size_must_be_positive(capsys, sides):
    a, b, _ = sides
    assert run(["diff", str(a), str(b), "--buffer-size", "0"]) == 2
    assert capsys.readouterr().err.strip() == "shardckpt: error: --buffer-size must be positive"


def test_pieces_cover_every_row_once_in_batches_within_the_limit():
    w = TensorMeta("w", (97, 48), torch.float32)
    w16 = TensorMeta("w16", (97, 48), torch.bfloat16)
    scalar = TensorMeta("s", (), torch.float32)
    empty = TensorMeta("e", (0, 4), torch.float32)
    pairs = [(w, w16, None), (scalar, scalar, None), (empty, empty, None), (w, w, (10, 60))]
    batches = pieces(pairs, 1000)
    rows: dict[int, list] = {}
    for batch in batches:
        # Within the limit on the wider side, and one piece of a tensor per batch.
        assert sum(max(p.nbytes(p.meta_a), p.nbytes(p.meta_b)) for p in batch) <= 1000
        assert len({p.meta_a.key for p in batch}) == len(batch)
        for p in batch:
            rows.setdefault(p.pair, []).append(p.rows)
    assert rows[0] == [(i, min(i + 5, 97)) for i in range(0, 97, 5)]
    assert rows[1] == [None]
    assert 2 not in rows
    assert rows[3] == [(i, min(i + 5, 60)) for i in range(10, 60, 5)]
    # A tensor within the limit is asked for whole, as the reader reads it best.
    assert [[p.rows for p in batch] for batch in pieces([(w, w, None)], 10**6)] == [[None]]
