"""Every command of docs/trainers/deepspeed.md runs as written on the goldens: ``ckpt/`` is a
ZeRO-2 run, ``checkpoint-500`` a ZeRO-3 one, ``ckpt-universal/`` a universal checkpoint
(torchrun lines run in tests/dist/test_deepspeed.py, at 2 ranks)."""

from __future__ import annotations

import re
import shlex
import shutil

import pytest
import torch
from deepspeed_goldens import run_dir, universal_dir, zero_to_fp32
from reference import assert_trees_equal
from safetensors.torch import load_file
from user_shell import REPO

from shardckpt.cli import run

PAGE = REPO / "docs" / "trainers" / "deepspeed.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def page_commands() -> list[str]:
    """Return the shardckpt command lines of the page's plain code blocks, in order."""
    return [
        line
        for lang, body in FENCE.findall(PAGE.read_text())
        if lang == ""
        for line in body.splitlines()
        if line.startswith("shardckpt ")
    ]


def test_the_page_has_its_commands():
    assert len(page_commands()) == 11


def test_every_command_of_the_page_runs_on_the_goldens(tmp_path, monkeypatch):
    shutil.copytree(run_dir("z2-bf16"), tmp_path / "ckpt")
    shutil.copytree(run_dir("z3-bf16"), tmp_path / "checkpoint-500")
    shutil.copytree(universal_dir("z2-bf16"), tmp_path / "ckpt-universal")
    monkeypatch.chdir(tmp_path)
    for line in page_commands():
        assert run([*shlex.split(line)[1:], "--quiet"]) == 0, line
    weights = zero_to_fp32("z2-bf16")
    assert_trees_equal(load_file(tmp_path / "weights.safetensors"), weights)
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert_trees_equal(full["model"], weights)
    assert_trees_equal(torch.load(tmp_path / "from-universal.pt", weights_only=True), full)
    module = torch.load(tmp_path / "module.pt", weights_only=True)
    assert module["fc1.weight"].dtype == torch.bfloat16
    assert sorted(p.name for p in (tmp_path / "fsdp-at-8").iterdir()) == [
        "optimizer_0",
        "pytorch_model_fsdp_0",
    ]
    assert len(list((tmp_path / "fsdp2-at-8").glob("*.distcp"))) == 8
    assert len(list((tmp_path / "ranks-at-8").glob("rank_*.pt"))) == 8
    hf = tmp_path / "hf-model" / "model.safetensors.index.json"
    assert hf.is_file()


@pytest.mark.parametrize("line", [line for line in page_commands() if "accelerate" in line])
def test_the_accelerate_output_holds_model_and_optimizer_as_accelerate_loads_them(tmp_path, line):
    shutil.copytree(run_dir("z2-fp32"), tmp_path / "checkpoint-500")
    argv = shlex.split(line.replace("fsdp-at-8", str(tmp_path / "acc")))[1:]
    argv[1] = str(tmp_path / "checkpoint-500")
    assert run([*argv, "--quiet"]) == 0
    run(["convert", str(tmp_path / "acc"), str(tmp_path / "acc.pt"), "--to", "full", "--quiet"])
    run(["convert", argv[1], str(tmp_path / "ds.pt"), "--to", "full", "--quiet"])
    acc = torch.load(tmp_path / "acc.pt", weights_only=True)
    ds = torch.load(tmp_path / "ds.pt", weights_only=True)
    assert_trees_equal(acc["model"], ds["model"])
    assert_trees_equal(acc["optimizer"], ds["optim"])
