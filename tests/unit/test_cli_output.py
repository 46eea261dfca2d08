"""What the commands print: one JSON document with --json, nothing with --quiet, no bar in CI."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest
import torch

from shardckpt.cli.app import run
from shardckpt.core.progress import Progress, human_bytes


def test_convert_json_is_one_document_with_the_spec_keys(tmp_path, capsys):
    torch.save({"model": {"w": torch.ones(7, 3)}, "epoch": 2}, tmp_path / "a.pt")
    assert (
        run(
            [
                "convert",
                str(tmp_path / "a.pt"),
                str(tmp_path / "b.safetensors"),
                "--to",
                "full",
                "--json",
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert {"src", "dst", "format", "layout", "world_size", "tensors", "nbytes", "seconds"} <= set(
        doc
    )
    assert (doc["format"], doc["layout"], doc["world_size"], doc["tensors"], doc["nbytes"]) == (
        "safetensors",
        "full",
        1,
        1,
        84,
    )
    assert err == ""


def test_quiet_convert_prints_nothing(tmp_path, capsys):
    torch.save({"w": torch.ones(2)}, tmp_path / "a.pt")
    assert (
        run(["convert", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "--to", "full", "--quiet"])
        == 0
    )
    assert capsys.readouterr() == ("", "")


def test_inspect_table_lists_leaves_optimizer_and_totals(tmp_path, capsys):
    sd = {
        "model": {"w": torch.ones(7, 3)},
        "optim": {
            "state": {"w": {"step": torch.tensor(1.0)}},
            "param_groups": [{"lr": 0.5, "params": ["w"]}],
        },
    }
    torch.save(sd, tmp_path / "a.pt")
    assert run(["inspect", str(tmp_path / "a.pt")]) == 0
    out = capsys.readouterr().out
    assert "model.w" in out and "7x3" in out and "optim.param_groups.0.lr" in out
    assert "optimizer optim: keys fqn, 1 param, 1 param group, state step" in out
    assert "total: 2 tensors, 88 B; float32 88 B" in out


def test_progress_bar_is_off_without_a_terminal_and_in_ci(monkeypatch):
    assert Progress(enabled=True).enabled is False  # pytest's stderr is not a terminal
    monkeypatch.setattr("sys.stderr.isatty", lambda: True, raising=False)
    monkeypatch.setenv("CI", "true")
    assert Progress(enabled=True).enabled is False
    monkeypatch.setenv("CI", "")
    assert Progress(enabled=True).enabled is True


@pytest.mark.launches
def test_on_a_terminal_every_phase_of_a_convert_shows_a_bar_in_binary_units(tmp_path):
    """Write, flush and --verify each get a bar; sizes and rates are both KiB/MiB (a real pty)."""
    if shutil.which("script") is None:
        pytest.skip("needs util-linux's script(1) to give the command a terminal")
    torch.save({"model": {"w": torch.randn(512, 256), "b": torch.randn(256)}}, tmp_path / "a.pt")
    cmd = f"{shlex.quote(sys.executable)} -m shardckpt convert {tmp_path / 'a.pt'} "
    cmd += f"{tmp_path / 'out'} --to sharded --world-size 2 --verify"
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "TQDM_DISABLE")}
    proc = subprocess.run(
        ["script", "-qec", f"stty cols 120 rows 40; {cmd}", "/dev/null"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout
    frames = proc.stdout.replace("\r", "\n")
    for phase in ("convert write: ", "convert flush to disk: ", "convert verify: "):
        assert phase in frames, frames
    total = human_bytes((512 * 256 + 256) * 4)
    assert f"0 B/{total} [" in frames, frames  # each bar's first frame; later ones are timed
    assert not re.search(r"\d[kMG]B/s|\d[kMG]B\b", frames), frames  # no decimal units
