"""What the commands print: one JSON document with --json, nothing with --quiet, no bar in CI."""

from __future__ import annotations

import json

import torch

from shardckpt.cli import run
from shardckpt.progress import Progress


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
