"""torch's flattened optimizer form, pure: parsing its keys, flattening and unflattening as
torch's ``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)`` does, and the CLI
around it (inspect, errors)."""

from __future__ import annotations

import json

import pytest
import torch
from optim_models import groups, trained
from reference import assert_trees_equal
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from shardckpt.cli.app import run
from shardckpt.plan.cast import cast_tree
from shardckpt.state.model import params_of
from shardckpt.state.optim import OrderError, RekeyError, flatten, key_type, rekey, unflatten
from shardckpt.state.tree import (
    FlatKey,
    TensorMeta,
    clean_fqn,
    is_flat_optimizer,
    is_optimizer,
    parse_flat,
    rename_keys,
    split_model_optim,
)

OPTIMIZERS = ["adamw", "sgd", "adagrad"]
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def both(name: str):
    """Return (model, torch's nested FQN optimizer state, torch's flattened one)."""
    model, opt = trained(name)
    return (
        model,
        get_optimizer_state_dict(model, opt),
        get_optimizer_state_dict(model, opt, options=FLAT),
    )


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_flatten_writes_exactly_what_torch_flattens_keys_in_order(name):
    _, nested, flat = both(name)
    assert is_flat_optimizer(flat) and key_type(flat) == "flat"
    ours = flatten(nested)
    assert list(ours) == list(flat)
    assert_trees_equal(ours, flat)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_unflatten_gives_what_torch_gives_unflattened(name):
    _, nested, flat = both(name)
    assert_trees_equal(unflatten(flat), nested)


def test_unflatten_with_the_models_groups_takes_membership_and_order_from_them():
    model, nested, flat = both("adamw")
    params = params_of(model, groups(model))
    assert_trees_equal(unflatten(flat, params), nested)


def test_parameters_of_one_group_must_share_hyperparameters():
    model, _, flat = both("adamw")
    flat["param_groups.fc.weight.lr"] = 0.5
    with pytest.raises(RekeyError, match="'embed.weight' and 'fc.weight' are in one param group"):
        unflatten(flat, params_of(model, groups(model)))
    # Without the model's groups, a different lr is a group of its own.
    assert len(unflatten(flat)["param_groups"]) == 3


def test_groups_with_equal_hyperparameters_become_one_without_the_model():
    # The flattened form cannot tell two such groups apart: only --model's groups can.
    _, nested, _ = both("adamw")
    first = {k: v for k, v in nested["param_groups"][0].items() if k != "params"}
    nested["param_groups"][1] = {**first, "params": nested["param_groups"][1]["params"]}
    (group,) = unflatten(flatten(nested))["param_groups"]
    assert group["params"] == [p for g in nested["param_groups"] for p in g["params"]]


def test_a_tensor_hyperparameter_needs_the_models_groups():
    flat = {"param_groups.w.lr": TensorMeta("k", (), torch.float32)}
    with pytest.raises(OrderError, match="hyper-parameter 'lr' of 'w' is a tensor"):
        unflatten(flat)


def test_state_keys_split_at_the_longest_fqn_of_the_param_groups():
    flat = {
        "state.a.step.exp_avg": 1,
        "state.a.step.nested.x": 2,
        "state.ghost.m": 3,
        "param_groups.a.step.lr": 0.1,
        "param_groups.a.lr": 0.1,
    }
    assert parse_flat(flat) == {
        "state.a.step.exp_avg": FlatKey("state", "a.step", "exp_avg"),
        "state.a.step.nested.x": FlatKey("state", "a.step", "nested.x"),
        "state.ghost.m": FlatKey("state", None, "ghost.m"),
        "param_groups.a.step.lr": FlatKey("param_groups", "a.step", "lr"),
        "param_groups.a.lr": FlatKey("param_groups", "a", "lr"),
    }
    with pytest.raises(RekeyError, match="'state.ghost.m' names no parameter in param_groups"):
        unflatten(flat)
    del flat["state.ghost.m"]
    assert unflatten(flat)["state"] == {"a.step": {"exp_avg": 1, "nested": {"x": 2}}}


def test_a_group_without_parameters_cannot_be_flattened():
    optim = {"state": {}, "param_groups": [{"lr": 0.1, "params": ["w"]}, {"lr": 0.2, "params": []}]}
    with pytest.raises(RekeyError, match="param group 1 has no parameters"):
        flatten(optim)


def test_flat_is_an_optimizer_and_a_model_state_is_not():
    assert is_optimizer({"state.w.m": 1, "param_groups.w.lr": 0.1})
    assert not is_flat_optimizer({"state.w.m": 1})  # no param group: not an optimizer
    assert not is_flat_optimizer({"param_groups.w.lr": 0.1, "weight": 2})
    tree = {"model": {"w": 1}, "optimizer": {"param_groups.w.lr": 0.1}}
    assert split_model_optim(tree, "optim") == {"optimizer": {"param_groups.w.lr": 0.1}}
    assert split_model_optim(tree, "model") == {"model": {"w": 1}}


def test_rekey_flat_keeps_renames_and_drops_key_by_key_in_order():
    _, _, flat = both("sgd")
    tree = {"optim": flat}

    def edit(fqn, _where):
        return None if fqn.startswith("norm.") else fqn.replace("fc.", "proj.")

    out = rekey(tree, "keep", edit)["optim"]
    expected = [
        k.replace(".fc.", ".proj.")
        for k in flat
        if not k.startswith(("state.norm.", "param_groups.norm."))
    ]
    assert list(out) == expected
    with pytest.raises(KeyError):
        rekey(tree, "keep", lambda fqn, _: "same")


def test_rekey_to_flat_and_to_ids_round_trips():
    model, nested, flat = both("adagrad")
    there = rekey({"model": model.state_dict(), "optim": flat}, "id")
    assert key_type(there["optim"]) == "id"
    back = rekey(there, "flat")
    assert list(back["optim"]) == list(flat)
    assert_trees_equal(back["optim"], flat)


def test_cast_optim_casts_flattened_state_but_not_step():
    tree = {
        "optim": {
            "state.w.exp_avg": TensorMeta("a", (3,), torch.float32),
            "state.w.step": TensorMeta("s", (), torch.float32),
            "param_groups.w.lr": 0.1,
        }
    }
    out, read_as = cast_tree(tree, torch.bfloat16, cast_optim=True)
    assert read_as == {"a": torch.float32}
    assert out["optim"]["state.w.step"].dtype == torch.float32


def _save_flat(tmp_path):
    model, _, flat = both("adamw")
    path = tmp_path / "flat.pt"
    torch.save({"model": model.state_dict(), "optimizer": flat}, path)
    return path, flat


def test_inspect_json_shows_the_flat_key_type_and_warns_about_stray_state(capsys, tmp_path):
    path, flat = _save_flat(tmp_path)
    flat["state.ghost.m"] = torch.zeros(1)
    del flat["state.fc.bias.exp_avg"], flat["state.fc.bias.exp_avg_sq"], flat["state.fc.bias.step"]
    torch.save({"optimizer": flat}, path)
    assert run(["inspect", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["optimizers"] == [
        {
            "path": ["optimizer"],
            "key_type": "flat",
            "num_params": 6,
            "state_names": ["exp_avg", "exp_avg_sq", "step"],
            "num_groups": 2,
            "param_names": False,
        }
    ]
    assert doc["warnings"] == [
        "optimizer: state for 1 key in no param group, e.g. 'state.ghost.m'",
        "optimizer: 1 parameter without state yet, e.g. 'fc.bias'",
    ]


def test_optim_keys_flat_on_a_group_without_parameters_is_one_line(capsys, tmp_path):
    optim = {"state": {}, "param_groups": [{"lr": 0.1, "params": ["w"]}, {"lr": 0.2, "params": []}]}
    torch.save({"model": {"w": torch.zeros(2)}, "optim": optim}, tmp_path / "o.pt")
    argv = ["convert", tmp_path / "o.pt", tmp_path / "f.pt", "--to", "full", "--optim-keys", "flat"]
    assert run([str(a) for a in argv]) == 3
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"shardckpt: error: '{tmp_path / 'o.pt'}': inconsistent optimizer state: param group 1 "
        "has no parameters, and the flattened form keeps hyper-parameters only beside a "
        "parameter: check the optimizer with `shardckpt inspect`"
    )


def test_a_tensor_learning_rate_asks_for_the_models_groups(capsys, tmp_path):
    flat = {"state.w.m": torch.zeros(2), "param_groups.w.lr": torch.tensor(0.1)}
    torch.save({"model": {"w": torch.zeros(2)}, "optim": flat}, tmp_path / "t.pt")
    argv = ["convert", tmp_path / "t.pt", tmp_path / "n.pt", "--to", "full", "--optim-keys", "fqn"]
    assert run([str(a) for a in argv]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"shardckpt: error: '{tmp_path / 't.pt'}': cannot tell the param groups of a flattened "
        "optimizer: hyper-parameter 'lr' of 'w' is a tensor, so parameters cannot be grouped by "
        "equal hyper-parameters without reading it: pass --model pkg.module:factory returning "
        "(module, param_groups)"
    )


def test_fqn_cleaning_cleans_the_fqn_inside_each_flattened_key():
    flat = {
        "state.module._orig_mod.w.exp_avg": 1,
        "param_groups.module._orig_mod.w.lr": 0.1,
        "param_groups.module.b.lr": 0.1,
    }
    assert rename_keys({"optim": flat}, clean_fqn) == {
        "optim": {"state.w.exp_avg": 1, "param_groups.w.lr": 0.1, "param_groups.b.lr": 0.1}
    }
