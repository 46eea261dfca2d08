"""``diff`` on two gloo ranks: each reads its rows of every tensor in windows, both sides at once.

A is written by torch's own ``dcp.save``, B by ``torch.save``; a 1 KiB buffer cuts each
rank's rows of the 97x48 tensor into one-row windows, so the ranks read different
numbers of batches and agree once, at the end.
"""

from __future__ import annotations

import pytest
import ranks
import torch
import torch.distributed.checkpoint as dcp
from harness import run_ranks


@pytest.mark.parametrize("row", [3, 90])
def test_two_ranks_reading_their_rows_in_windows_find_the_same_difference(tmp_path, row):
    # Rank 0 reads rows 0-48 of w, rank 1 rows 49-96.
    gen = torch.Generator().manual_seed(0)
    a = {"w": torch.randn(97, 48, generator=gen), "b": torch.randn(48, generator=gen)}
    b = {k: v.clone() for k, v in a.items()}
    b["w"][row, 0] = -b["w"][row, 0]
    dcp.save(a, checkpoint_id=tmp_path / "a", no_dist=True)
    torch.save(b, tmp_path / "b.pt")
    argv = (str(tmp_path / "a"), str(tmp_path / "b.pt"), {"buffer_bytes": 1024})
    results = run_ranks(ranks.diff, 2, *argv, timeout=300)
    assert results[0] == results[1] == [(("w",), "values differ")]
    same = run_ranks(
        ranks.diff, 2, str(tmp_path / "a"), str(tmp_path / "a"), {"buffer_bytes": 1024}
    )
    assert same == [[], []]
