"""End to end: the installed CLI under a real torchrun, as users launch it.

torchrun's agent forks warm (``warm_cli.run_torchrun``: torch's own ``main``, its import
of torch saved); the ranks it starts are fresh ``python -u -m shardckpt`` processes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import damage
import pytest
import warm_cli

from shardckpt.cli.app import run


def torchrun(nproc: int, *argv: str) -> subprocess.CompletedProcess:
    cmd = ["--standalone", f"--nproc-per-node={nproc}", "-m", "shardckpt", *map(str, argv)]
    env = dict(os.environ, OMP_NUM_THREADS="1", SHARDCKPT_TIMEOUT="60")
    proc = warm_cli.run_torchrun(cmd, env=env, timeout=150)
    if proc.returncode == 0:
        # torch's own warnings (glog-style "W1123 ..." lines, Python warnings) say nothing
        # to our users; a successful run prints none.
        noise = [ln for ln in proc.stderr.splitlines() if re.match(r"[WE]\d{4} |.*Warning: ", ln)]
        assert not noise, noise
    return proc


def test_torchrun_two_ranks_converts_to_the_same_bytes_and_prints_once(fsdp2_ckpt, tmp_path):
    assert (
        run(["convert", str(fsdp2_ckpt.dcp), str(tmp_path / "one.pt"), "--to", "full", "--quiet"])
        == 0
    )
    proc = torchrun(2, "convert", fsdp2_ckpt.dcp, tmp_path / "two" / "full.pt", "--to", "full")
    assert proc.returncode == 0, proc.stderr
    summaries = [line for line in proc.stdout.splitlines() if line.startswith("wrote ")]
    assert len(summaries) == 1 and "one torch file in" in summaries[0]  # rank 0's alone
    assert (tmp_path / "two" / "full.pt").read_bytes() == (tmp_path / "one.pt").read_bytes()


def test_torchrun_sharded_output_round_trips(fsdp2_ckpt, tmp_path):
    proc = torchrun(
        2, "convert", fsdp2_ckpt.dcp, tmp_path / "resharded", "--to", "sharded", "--json"
    )
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stdout.splitlines()  # one JSON summary, rank 0's
    assert json.loads(line)["world_size"] == 2
    # No --world-size: the launch's is used, and said once.
    note = "shardckpt: note: writing DST for world size 2, the launch's"
    assert proc.stderr.count(note) == 1, proc.stderr
    assert run(["diff", str(fsdp2_ckpt.dcp), str(tmp_path / "resharded")]) == 0


def test_torchrun_two_ranks_write_a_checkpoint_for_five(fsdp2_ckpt, tmp_path):
    dst = tmp_path / "at5"
    proc = torchrun(
        2, "convert", fsdp2_ckpt.dcp, dst, "--to", "sharded", "--world-size", "5", "--json"
    )
    assert proc.returncode == 0, proc.stderr
    assert '"world_size": 5' in proc.stdout
    assert sorted(p.name for p in dst.iterdir()) == [".metadata"] + [
        f"__{r}_0.distcp" for r in range(5)
    ]
    assert run(["diff", str(fsdp2_ckpt.dcp), str(dst)]) == 0


@pytest.mark.parametrize(
    "argv", [["inspect", "missing-dir"], ["convert", "missing-dir", "out.pt", "--to", "full"]]
)
def test_torchrun_failure_prints_the_error_once_and_fails(tmp_path, argv):
    proc = torchrun(
        2, *[str(tmp_path / a) if a.startswith(("missing", "out")) else a for a in argv]
    )
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("shardckpt: error:")]
    assert lines == [
        f"shardckpt: error: '{tmp_path / 'missing-dir'}': no such file or directory: "
        "check the path of the checkpoint"
    ]
    # torchrun's root-cause summary carries our line, not a Python stack of ours.
    root_cause = proc.stderr.split("Root Cause")[-1]
    assert "shardckpt: error:" in root_cause and "shardckpt/cli/app.py" not in root_cause
    assert not (tmp_path / "out.pt").exists()


def test_python_dash_m_runs_standalone(fsdp2_ckpt):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardckpt",
            "inspect",
            str(fsdp2_ckpt.dcp),
            "--filter",
            "model.embed*",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "model.embed.weight" in proc.stdout and "Shard(0) over 4" in proc.stdout


def test_torchrun_writes_per_rank_files_for_another_world_size(fsdp2_ckpt, tmp_path):
    proc = torchrun(
        2, "convert", fsdp2_ckpt.dcp, tmp_path / "ranks3", "--to", "local", "--world-size", "3"
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "ranks3").iterdir()) == [
        "rank_0.pt",
        "rank_1.pt",
        "rank_2.pt",
    ]
    assert (
        run(
            [
                "convert",
                str(fsdp2_ckpt.dcp),
                str(tmp_path / "one"),
                "--to",
                "local",
                "--world-size",
                "3",
                "-q",
            ]
        )
        == 0
    )
    for name in ("rank_0.pt", "rank_1.pt", "rank_2.pt"):
        assert (tmp_path / "ranks3" / name).read_bytes() == (
            tmp_path / "one" / name
        ).read_bytes(), name
    assert run(["diff", str(fsdp2_ckpt.dcp), str(tmp_path / "ranks3")]) == 0


def test_torchrun_two_ranks_verify_reads_every_byte_and_says_damage_once(fsdp2_ckpt, tmp_path):
    proc = torchrun(2, "verify", fsdp2_ckpt.dcp, "--json")
    assert proc.returncode == 0, proc.stderr
    size = sum(p.stat().st_size for p in fsdp2_ckpt.dcp.iterdir())
    assert proc.stdout.count("{") == 1 and f'"bytes": {size},' in proc.stdout
    src = damage.copy(fsdp2_ckpt.dcp, tmp_path / "dcp")
    flipped = damage.flip_in_dcp(src, "optim.state.blocks.1.fc_out.weight.exp_avg_sq")
    proc = torchrun(2, "verify", src)
    assert proc.returncode == 1  # torchrun's, for any failing worker
    assert proc.stdout.count(flipped.message()) == 1 and proc.stdout.startswith("damaged: ")
    # Printed once by rank 0 (torchrun's root-cause summary quotes it again, in its own words).
    assert proc.stderr.splitlines().count(flipped.line()) == 1, proc.stderr
