"""torch's flattened optimizer form (``flatten_optimizer_state_dict=True``) is an optimizer:
inspected with key type ``flat``, selected by ``--only``, edited by ``--drop``, left out of
``hf``, rekeyed to the nested FQN form and back; torch's own ``set_state_dict`` loads each result."""

from __future__ import annotations

import pytest
import torch

import flat_optim_ranks
from harness import run_ranks
from reference import assert_trees_equal, example
from shardckpt import api


@pytest.fixture(scope="module")
def flat_ckpt(tmp_path_factory):
    """Return a DCP saved by FSDP2 at 2 ranks, optimizer flattened, and its full nested truth."""
    path = tmp_path_factory.mktemp("flat") / "dcp"
    truth = run_ranks(flat_optim_ranks.save_flat, 2, str(path))[0]
    return path, truth


def test_the_saved_optimizer_is_flattened_as_torch_flattens_it(flat_ckpt):
    meta = api.inspect(api.InspectRequest(src=flat_ckpt[0]))
    keys = [p[1] for p, _ in meta.leaves if p[0] == "optim"]
    assert "state.embed.weight.exp_avg" in keys
    assert "param_groups.blocks.0.fc_in.bias.lr" in keys


def test_inspect_shows_a_flattened_optimizer_with_key_type_flat_and_its_groups(flat_ckpt):
    (info,) = api.inspect(api.InspectRequest(src=flat_ckpt[0])).optimizers
    assert info.path == ("optim",)
    assert info.key_type == "flat"
    assert info.state_names == ("exp_avg", "exp_avg_sq", "step")
    # The example's two AdamW groups: matrices decay, vectors do not.
    assert info.num_groups == 2
    assert info.num_params == len(list(example.build_model(0).parameters()))


def test_flat_to_nested_fqn_at_three_loads_with_set_state_dict_bit_exactly(flat_ckpt, tmp_path):
    src, truth = flat_ckpt
    dst = tmp_path / "nested"
    api.convert(api.ConvertRequest(src=src, dst=dst, to="sharded", world_size=3, optim_keys="fqn"))
    (info,) = api.inspect(api.InspectRequest(src=dst)).optimizers
    assert (info.key_type, info.num_groups) == ("fqn", 2)
    assert_trees_equal(run_ranks(flat_optim_ranks.load, 3, str(dst), False)[0], truth)


def test_nested_back_to_flat_loads_with_the_flattened_set_state_dict(flat_ckpt, tmp_path):
    src, truth = flat_ckpt
    nested, flat = tmp_path / "nested.pt", tmp_path / "flat"
    api.convert(api.ConvertRequest(src=src, dst=nested, to="full", optim_keys="fqn"))
    api.convert(api.ConvertRequest(src=nested, dst=flat, to="sharded", world_size=3, optim_keys="flat"))
    assert api.inspect(api.InspectRequest(src=flat)).optimizers[0].key_type == "flat"
    # Every leaf is the one torch flattened: same keys, values, types.
    assert not api.diff(api.DiffRequest(a=src, b=flat)).differences
    assert_trees_equal(run_ranks(flat_optim_ranks.load, 3, str(flat), True)[0], truth)


def test_flat_to_param_ids_loads_into_a_plain_adamw(flat_ckpt, tmp_path):
    src, truth = flat_ckpt
    api.convert(api.ConvertRequest(src=src, dst=tmp_path / "plain.pt", to="full", optim_keys="id"))
    out = torch.load(tmp_path / "plain.pt", weights_only=True)
    model = example.build_model(1234)
    optimizer = example.build_optimizer(model)
    optimizer.load_state_dict(out["optim"])
    ref_model = example.build_model(1234)
    ref_optimizer = example.build_optimizer(ref_model)
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(
        ref_model, ref_optimizer, model_state_dict=truth["model"], optim_state_dict=truth["optim"]
    )
    assert_trees_equal(optimizer.state_dict(), ref_optimizer.state_dict())


def test_only_optim_keeps_the_flattened_optimizer_and_only_model_leaves_it_out(
    flat_ckpt, tmp_path
):
    src = flat_ckpt[0]
    api.convert(api.ConvertRequest(src=src, dst=tmp_path / "optim.pt", to="full", only="optim"))
    api.convert(api.ConvertRequest(src=src, dst=tmp_path / "model.pt", to="full", only="model"))
    assert list(torch.load(tmp_path / "optim.pt", weights_only=True)) == ["optim"]
    # One file of the model alone holds its FQNs at the root, as load_state_dict takes them.
    model = torch.load(tmp_path / "model.pt", weights_only=True)
    assert "model" not in model and all(isinstance(v, torch.Tensor) for v in model.values())


def test_drop_removes_a_parameter_from_the_flattened_optimizer_too(flat_ckpt, tmp_path):
    src = flat_ckpt[0]
    api.convert(api.ConvertRequest(src=src, dst=tmp_path / "out.pt", to="full", edits=[("--drop", r"^blocks\.1\.")]))
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert not [k for k in out["model"] if k.startswith("blocks.1.")]
    assert not [k for k in out["optim"] if ".blocks.1." in k]
    assert "state.blocks.0.fc_in.weight.exp_avg" in out["optim"]
    assert "param_groups.blocks.0.fc_in.weight.lr" in out["optim"]


def test_an_hf_export_holds_no_flattened_optimizer_state(flat_ckpt, tmp_path):
    src = flat_ckpt[0]
    api.convert(api.ConvertRequest(src=src, dst=tmp_path / "hf", to="full", format="hf"))
    names = {p[-1] for p, _ in api.inspect(api.InspectRequest(src=tmp_path / "hf")).leaves}
    assert names == set(example.build_model(0).state_dict())
