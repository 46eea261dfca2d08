"""Acceptance: a real FSDP2 DCP checkpoint (world size 4) through every conversion, checked
against what torch itself produces (get_state_dict full state, dcp_to_torch_save, FSDP2 loads)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

import ranks
from harness import run_ranks
from reference import assert_trees_equal, dcp_to_torch_save_reference, load_dcp_into_fsdp2
from shardckpt import api
from shardckpt.cli.app import run
from shardckpt.formats.hf.safetensors_file import TREE_KEY
from shardckpt.codecs.json_values import decode_tree


@pytest.fixture(scope="module")
def ref(fsdp2_ckpt):
    return torch.load(fsdp2_ckpt.ref, weights_only=True)


@pytest.fixture(scope="module")
def full(fsdp2_ckpt, tmp_path_factory):
    """The checkpoint converted standalone to torch and safetensors."""
    out = tmp_path_factory.mktemp("full")
    api.convert(api.ConvertRequest(src=fsdp2_ckpt.dcp, dst=out / "full.pt", to="full"))
    api.convert(api.ConvertRequest(src=fsdp2_ckpt.dcp, dst=out / "full.safetensors", to="full"))
    return out


def read_safetensors_with_the_library(path):
    flat = load_file(path)
    with safe_open(path, framework="pt") as f:
        tree_json = json.loads(f.metadata()[TREE_KEY])
    return decode_tree(tree_json, flat.__getitem__)


def test_inspect_json_lists_every_leaf_with_the_full_state_shapes_and_dtypes(fsdp2_ckpt, ref, capsys):
    assert run(["inspect", str(fsdp2_ckpt.dcp), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == 1 and doc["format"] == "dcp" and doc["world_size"] == 4
    flat, paths = flatten_state_dict(ref)  # torch's own flattening names the leaves
    tensors = {tuple(e["path"]): e for e in doc["entries"] if e["kind"] == "tensor"}
    expected = {paths[k]: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    assert set(tensors) == set(expected)
    for path, t in expected.items():
        e = tensors[path]
        assert (e["shape"], e["dtype"], e["nbytes"]) == (list(t.shape), str(t.dtype)[6:], t.nbytes), path
    values = {tuple(e["path"]) for e in doc["entries"] if e["kind"] == "value"}
    assert values == {paths[k] for k, v in flat.items() if not isinstance(v, torch.Tensor)}
    assert any(e["layout"] == "Shard(0) over 4" for e in tensors.values())
    (optim,) = doc["optimizers"]
    assert optim["path"] == ["optim"] and optim["key_type"] == "fqn" and optim["num_groups"] == 2
    assert optim["state_names"] == ["exp_avg", "exp_avg_sq", "step"]
    assert optim["num_params"] == sum(len(g["params"]) for g in ref["optim"]["param_groups"])
    assert doc["totals"]["tensors"] == len(expected)


def test_full_torch_output_equals_the_full_state_dict_and_dcp_to_torch_save(fsdp2_ckpt, full, ref, tmp_path):
    out = torch.load(full / "full.pt", weights_only=True)
    assert_trees_equal(out, ref)
    theirs = torch.load(dcp_to_torch_save_reference(fsdp2_ckpt.dcp, tmp_path / "theirs.pt"), weights_only=False)
    assert_trees_equal(out, theirs)


def test_full_safetensors_output_equals_the_full_state_dict(full, ref):
    assert_trees_equal(read_safetensors_with_the_library(full / "full.safetensors"), ref)


def test_two_ranks_write_the_same_bytes_as_one(fsdp2_ckpt, full, tmp_path):
    for name in ("full.pt", "full.safetensors"):
        run_ranks(ranks.convert, 2, str(fsdp2_ckpt.dcp), str(tmp_path / name), "full", {})
        assert (tmp_path / name).read_bytes() == (full / name).read_bytes(), name


@pytest.mark.parametrize("name", ["full.pt", "full.safetensors"])
def test_full_to_sharded_at_two_ranks_loads_into_fsdp2_at_two_and_three(full, ref, tmp_path, name):
    dst = tmp_path / "resharded"
    (summary, _) = run_ranks(ranks.convert, 2, str(full / name), str(dst), "sharded", {"verify": True})
    assert summary["world_size"] == 2 and summary["verified"] is True
    assert sorted(p.name for p in dst.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    for world_size in (2, 3):
        assert_trees_equal(load_dcp_into_fsdp2(dst, world_size), ref)


def test_sharded_output_of_one_rank_also_loads_into_fsdp2(full, ref, tmp_path):
    api.convert(api.ConvertRequest(src=full / "full.pt", dst=tmp_path / "one", to="sharded", world_size=1))
    assert_trees_equal(load_dcp_into_fsdp2(tmp_path / "one", 2), ref)


def test_diff_is_zero_for_a_conversion_and_names_the_one_changed_element(fsdp2_ckpt, full, tmp_path, capsys):
    assert run(["diff", str(fsdp2_ckpt.dcp), str(full / "full.safetensors")]) == 0
    changed = torch.load(full / "full.pt", weights_only=True)
    changed["optim"]["state"]["blocks.1.fc_out.weight"]["exp_avg"][5, 2] += 0.25
    torch.save(changed, tmp_path / "changed.pt")
    capsys.readouterr()
    assert run(["diff", str(fsdp2_ckpt.dcp), str(tmp_path / "changed.pt"), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["equal"] is False
    assert [d["path"] for d in doc["differences"]] == [["optim", "state", "blocks.1.fc_out.weight", "exp_avg"]]
    assert doc["differences"][0]["max_abs_diff"] == pytest.approx(0.25, abs=1e-6)
    assert run(["diff", str(fsdp2_ckpt.dcp), str(tmp_path / "changed.pt"), "--atol", "0.3"]) == 0


def test_diff_on_two_ranks_finds_the_same_difference(fsdp2_ckpt, full, tmp_path):
    changed = torch.load(full / "full.pt", weights_only=True)
    changed["model"]["embed.weight"][96, 47] = -1.0  # the last row: held by the last rank
    torch.save(changed, tmp_path / "changed.pt")
    results = run_ranks(ranks.diff, 2, str(fsdp2_ckpt.dcp), str(tmp_path / "changed.pt"))
    assert results[0] == results[1] == [(("model", "embed.weight"), "values differ")]


def test_only_model_and_only_optim_split_the_checkpoint(fsdp2_ckpt, ref, tmp_path):
    api.convert(api.ConvertRequest(src=fsdp2_ckpt.dcp, dst=tmp_path / "model.pt", to="full", only="model"))
    api.convert(api.ConvertRequest(src=fsdp2_ckpt.dcp, dst=tmp_path / "optim.pt", to="full", only="optim"))
    # One file of the model alone is rooted as load_state_dict takes it (issue 23).
    assert_trees_equal(torch.load(tmp_path / "model.pt", weights_only=True), ref["model"])
    assert_trees_equal(torch.load(tmp_path / "optim.pt", weights_only=True), {"optim": ref["optim"]})


def test_a_rank_that_fails_makes_every_rank_fail_with_its_error(fsdp2_ckpt, tmp_path):
    # Rank 1 reads its own copy, whose last data file is zeroed (same size, so the ranks
    # see the same listing): only rank 1 meets the damage.
    copy = shutil.copytree(fsdp2_ckpt.dcp, tmp_path / "copy")
    damaged = copy / "__3_0.distcp"
    damaged.write_bytes(bytes(damaged.stat().st_size))
    results = run_ranks(ranks.convert_expecting_failure, 2, [str(fsdp2_ckpt.dcp), str(copy)],
                        str(tmp_path / "out.pt"), "full")
    kind, code, line = results[1]
    assert (kind, code) == ("BadInputError", 3) and str(damaged) in line, results[1]
    assert results[0] == ("RemoteRankError", 3, f"rank 1 failed: {line}")
    assert not (tmp_path / "out.pt").exists()


def test_source_is_never_modified(fsdp2_ckpt, tmp_path):
    before = {p.name: p.read_bytes() for p in fsdp2_ckpt.dcp.iterdir()}
    shutil.copytree(fsdp2_ckpt.dcp, tmp_path / "copy")
    api.convert(api.ConvertRequest(src=tmp_path / "copy", dst=tmp_path / "out", to="sharded", world_size=1))
    assert {p.name: p.read_bytes() for p in fsdp2_ckpt.dcp.iterdir()} == before
