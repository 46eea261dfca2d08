"""Acceptance for ``hf``: FSDP2 training state -> Hugging Face shards -> DCP that FSDP2
training starts from, checked against torch's own full state and real FSDP2 loads."""

from __future__ import annotations

import json

import pytest
import ranks
import torch
from harness import run_ranks
from reference import assert_trees_equal, load_dcp_model_into_fsdp2
from safetensors.torch import load_file

from shardckpt import api
from shardckpt.formats.hf.sharded import INDEX_FILE

LIMIT = 8000  # bytes per shard: the example model needs several


@pytest.fixture(scope="module")
def ref(fsdp2_ckpt):
    return torch.load(fsdp2_ckpt.ref, weights_only=True)


@pytest.fixture(scope="module")
def hf(fsdp2_ckpt, tmp_path_factory):
    """The FSDP2 checkpoint written standalone as Hugging Face shards."""
    out = tmp_path_factory.mktemp("hf") / "hf"
    api.convert(api.ConvertRequest(src=fsdp2_ckpt.dcp, dst=out, to="full", format="hf", max_shard_size=LIMIT, verify=True))
    return out


def test_hf_output_holds_the_model_state_under_plain_fqns(hf, ref):
    index = json.loads((hf / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and sorted(p.name for p in hf.iterdir()) == [*files, INDEX_FILE]
    tensors = {name: t for f in files for name, t in load_file(hf / f).items()}
    assert sorted(index["weight_map"]) == sorted(tensors)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    assert_trees_equal(tensors, ref["model"])  # tied embed/head: both keys, each whole


def test_two_ranks_write_the_same_shards_as_one(fsdp2_ckpt, hf, tmp_path):
    kwargs = {"format": "hf", "max_shard_size": LIMIT}
    run_ranks(ranks.convert, 2, str(fsdp2_ckpt.dcp), str(tmp_path / "hf"), "full", kwargs)
    assert {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()} == {
        p.name: p.read_bytes() for p in hf.iterdir()
    }


def test_hf_to_dcp_loads_into_fsdp2_as_model_weights(hf, ref, tmp_path):
    dst = tmp_path / "init"
    (summary, _) = run_ranks(ranks.convert, 2, str(hf), str(dst), "sharded", {"verify": True})
    assert summary["verified"] is True
    for world_size in (2, 3):
        assert_trees_equal(load_dcp_model_into_fsdp2(dst, world_size), ref["model"])


def test_bf16_hf_export_is_the_cast_of_the_full_state(fsdp2_ckpt, ref, tmp_path):
    kwargs = {"format": "hf", "dtype": "bf16", "verify": True}
    run_ranks(ranks.convert, 2, str(fsdp2_ckpt.dcp), str(tmp_path / "hf"), "full", kwargs)
    (shard,) = [p for p in (tmp_path / "hf").iterdir() if p.suffix == ".safetensors"]
    expected = {k: t.to(torch.bfloat16) for k, t in ref["model"].items()}
    assert_trees_equal(load_file(shard), expected)
