"""Under N processes, the coordinator reports every rank's peak memory and the bytes all wrote."""

from __future__ import annotations

import ranks
from harness import run_ranks


def test_two_processes_report_each_ranks_peak_memory_to_rank_0(fsdp2_ckpt, tmp_path):
    dst = tmp_path / "at3"
    first, second = run_ranks(
        ranks.convert_costs, 2, str(fsdp2_ckpt.dcp), str(dst), "sharded", {"world_size": 3}
    )
    assert second is None
    assert len(first["peak_rss_bytes"]) == 2
    assert all(peak > 50 * 2**20 for peak in first["peak_rss_bytes"])
    data = sum(p.stat().st_size for p in dst.iterdir() if p.name != ".metadata")
    # Each process wrote the data files of the target ranks it acts for: together, all.
    assert first["written_bytes"] == data
    assert sum(first["phase_seconds"].values()) <= first["wall_seconds"] + 0.006
