"""Sources saved from 2-D meshes (HSDP, FSDP+TP) convert to what the training job holds."""

from __future__ import annotations

import json

import pytest
import torch

import meshes
import ranks
from harness import run_ranks
from reference import assert_trees_equal
from shardckpt import api
from shardckpt.cli.app import run


@pytest.fixture(scope="module", params=["hsdp", "fsdp_tp"])
def job(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    train = {"hsdp": meshes.train_hsdp, "fsdp_tp": meshes.train_fsdp_tp}[request.param]
    run_ranks(train, 4, str(root / "dcp"), str(root / "ref.pt"))
    return root


def test_two_d_checkpoint_to_full_equals_the_jobs_full_state(job, tmp_path):
    api.convert(api.ConvertRequest(src=job / "dcp", dst=tmp_path / "full.pt", to="full"))
    assert_trees_equal(torch.load(tmp_path / "full.pt", weights_only=True), torch.load(job / "ref.pt"))


def test_two_d_checkpoint_converts_the_same_on_two_ranks(job, tmp_path):
    api.convert(api.ConvertRequest(src=job / "dcp", dst=tmp_path / "one.safetensors", to="full"))
    run_ranks(ranks.convert, 2, str(job / "dcp"), str(tmp_path / "two.safetensors"), "full", {})
    assert (tmp_path / "one.safetensors").read_bytes() == (tmp_path / "two.safetensors").read_bytes()


def test_two_d_checkpoint_to_sharded_keeps_every_value(job, tmp_path):
    run_ranks(ranks.convert, 2, str(job / "dcp"), str(tmp_path / "dcp2"), "sharded", {})
    api.convert(api.ConvertRequest(src=tmp_path / "dcp2", dst=tmp_path / "full.pt", to="full"))
    assert_trees_equal(torch.load(tmp_path / "full.pt", weights_only=True), torch.load(job / "ref.pt"))


def test_inspect_reads_each_tensor_once_with_its_full_shape(job, capsys):
    assert run(["inspect", str(job / "dcp"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    ref = torch.load(job / "ref.pt")
    for e in doc["entries"]:
        if e["kind"] == "tensor" and e["path"][0] == "model":
            assert e["shape"] == list(ref["model"][e["path"][1]].shape)
