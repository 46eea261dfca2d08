"""What a conversion reports it cost: phase times, bytes, peak memory (``--json``'s ``costs``)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from conditions import memory_capped

from shardckpt import api
from shardckpt.cli.app import run
from shardckpt.core.costs import combined

PHASES = ["plan", "frame", "write", "flush", "finish"]


def _source(tmp_path):
    src = tmp_path / "a.pt"
    torch.save({"model": {"w": torch.arange(97 * 48.0).reshape(97, 48), "b": torch.ones(7)}}, src)
    return src


def test_the_phases_of_a_conversion_add_up_to_at_most_its_wall_time(tmp_path):
    result = api.convert(
        api.ConvertRequest(
            src=_source(tmp_path), dst=tmp_path / "out", to="sharded", world_size=3, verify=True
        )
    )
    costs = result.costs
    assert list(costs["phase_seconds"]) == [*PHASES, "verify"]
    assert all(s >= 0 for s in costs["phase_seconds"].values())
    # The phases follow each other inside the call; rounding to ms is the only slack.
    assert sum(costs["phase_seconds"].values()) <= costs["wall_seconds"] + 0.006
    assert costs["wall_seconds"] <= result.seconds + 0.001
    assert costs["read_bytes"] == result.nbytes == (97 * 48 + 7) * 4
    # DCP writes each chunk as a torch.save of it, and .metadata: more than the data.
    written = sum(p.stat().st_size for p in (tmp_path / "out").iterdir())
    metadata = (tmp_path / "out" / ".metadata").stat().st_size
    assert costs["written_bytes"] == written - metadata
    assert len(costs["peak_rss_bytes"]) == 1
    # Importing torch alone takes more than 50 MB: this is the process's resident memory.
    assert costs["peak_rss_bytes"][0] > 50 * 2**20


def test_convert_json_carries_the_costs_and_the_summary_names_them(tmp_path, capsys):
    src = _source(tmp_path)
    args = ["convert", str(src), str(tmp_path / "b.safetensors"), "--to", "full"]
    assert run([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    costs = doc["costs"]
    assert list(costs["phase_seconds"]) == PHASES
    assert costs["wall_seconds"] == doc["seconds"]
    assert sum(costs["phase_seconds"].values()) <= doc["seconds"]
    assert costs["written_bytes"] == doc["nbytes"] == (97 * 48 + 7) * 4
    assert set(costs) >= {"read_bytes", "write_gb_per_s", "peak_rss_bytes", "phase_cpu_seconds"}
    assert run([*args[:2], str(tmp_path / "c.safetensors"), "--to", "full"]) == 0
    line = capsys.readouterr().out.strip()
    assert re.fullmatch(
        r"wrote \S+c\.safetensors: 2 tensors \(18\.2 KiB\) and 0 values, one safetensors file "
        r"in \d+\.\d s \(plan \d+\.\d, frame \d+\.\d, write \d+\.\d, flush \d+\.\d, "
        r"finish \d+\.\d s; read 18\.2 KiB, wrote 18\.2 KiB( at \d+\.\d\d GB/s)?; "
        r"peak RSS \d+\.\d [MG]iB\)",  # this process's: pytest's, in-process
        line,
    ), line


def test_ranks_costs_combine_as_the_slowest_phase_the_summed_bytes_and_each_ranks_memory():
    reports = [
        {
            "seconds": {"plan": 1.0, "write": 2.0},
            "cpu_seconds": {"plan": 0.5, "write": 1.5},
            "read_bytes": 10,
            "written_bytes": 2 * 10**9,
            "peak_rss_bytes": 300,
        },
        {
            "seconds": {"plan": 1.5, "write": 1.0},
            "cpu_seconds": {"plan": 0.25, "write": 1.0},
            "read_bytes": 20,
            "written_bytes": 2 * 10**9,
            "peak_rss_bytes": 400,
        },
    ]
    assert combined(reports, 4.0) == {
        "wall_seconds": 4.0,
        "phase_seconds": {"plan": 1.5, "write": 2.0},
        "phase_cpu_seconds": {"plan": 0.75, "write": 2.5},
        "read_bytes": 30,
        "written_bytes": 4 * 10**9,
        "write_gb_per_s": 2.0,
        "peak_rss_bytes": [300, 400],
        "peak_cgroup_bytes": [None, None],
    }


@pytest.mark.launches
def test_a_process_in_a_memory_cgroup_of_its_own_reports_what_the_cgroup_was_charged(tmp_path):
    src = _source(tmp_path)
    big = tmp_path / "big.pt"
    torch.save({"w": torch.ones(64, 2**20, dtype=torch.uint8)}, big)  # 64 MiB: page cache
    argv = [sys.executable, "-m", "shardckpt", "convert", "--json", "--to", "full"]
    with memory_capped(2**40) as cap:
        done = subprocess.run(
            [*cap.prefix, *argv, str(big), str(tmp_path / "b.safetensors")],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        peak = cap.peak()
    costs = json.loads(done.stdout)["costs"]
    (charged,) = costs["peak_cgroup_bytes"]
    # Read by the process before it ended: at most the cgroup's peak, and it counts the
    # page cache of the 64 MiB read and written that resident memory leaves out.
    assert charged is not None and charged <= peak
    assert charged >= peak - 32 * 2**20
    # Not alone in a cgroup (this test's process shares pytest's): no figure, not the group's.
    doc = json.loads(
        subprocess.run(
            [*argv, str(src), str(tmp_path / "c.safetensors")],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
    )
    assert doc["costs"]["peak_cgroup_bytes"] == [None]
