"""Optimizer keys, pure: param IDs <-> FQNs as plain torch.optim and get_state_dict name them."""

from __future__ import annotations

import copy

import pytest
import torch
from optim_models import groups, tiny, trained
from reference import assert_trees_equal
from torch.distributed.checkpoint.state_dict import get_state_dict

from shardckpt.state.model import params_of
from shardckpt.state.optim import (
    Candidate,
    OrderError,
    RekeyError,
    fqn_names,
    fqns_to_ids,
    ids_to_fqns,
    infer_groups,
    key_type,
    map_fqns,
    model_candidates,
    normalize_ids,
    rekey,
)

OPTIMIZERS = ["adamw", "sgd", "adagrad"]
EXPECTED_GROUPS = [
    ["embed.weight", "fc.weight", "head.weight"],
    ["fc.bias", "norm.weight", "norm.bias"],
]


def states(name: str):
    """Return (model, torch.optim's ID-keyed state dict, get_state_dict's FQN-keyed one)."""
    model, opt = trained(name)
    return model, opt.state_dict(), get_state_dict(model, opt)[1]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fqn_to_id_equals_what_plain_torch_optim_saves(name):
    _, by_id, by_fqn = states(name)
    assert key_type(by_fqn) == "fqn" and key_type(by_id) == "id"
    assert_trees_equal(fqns_to_ids(by_fqn), by_id)
    assert list(fqns_to_ids(by_fqn)["state"]) == list(by_id["state"])


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_id_to_fqn_with_the_model_groups_equals_get_state_dict(name):
    model, by_id, by_fqn = states(name)
    params = params_of(model, groups(model))
    assert params.groups == tuple(tuple(g) for g in EXPECTED_GROUPS)
    assert_trees_equal(ids_to_fqns(by_id, params.groups), by_fqn)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_id_fqn_id_round_trip_is_exact(name):
    model, by_id, _ = states(name)
    there = rekey({"model": model.state_dict(), "optim": by_id}, "fqn")
    back = rekey(there, "id")
    assert key_type(there["optim"]) == "fqn"
    assert_trees_equal(back["optim"], by_id)


def test_inference_from_the_model_state_skips_buffers_and_the_second_tied_name():
    model, by_id, by_fqn = states("adamw")
    tree = {"model": model.state_dict(), "optim": by_id}
    names = [c.fqn for c in model_candidates(tree, ("optim",))]
    assert names == [
        "scale",
        "embed.weight",
        "fc.weight",
        "fc.bias",
        "norm.weight",
        "norm.bias",
        "head.weight",
        "tied.weight",
    ]
    assert infer_groups(by_id, model_candidates(tree, ("optim",))) == EXPECTED_GROUPS
    assert_trees_equal(rekey(tree, "fqn")["optim"], by_fqn)


def test_inference_from_a_bare_module_keeps_model_order_in_each_group():
    model, by_id, _ = states("sgd")
    assert (
        rekey({"optim": by_id}, "fqn", model=params_of(model))["optim"]["param_groups"][1]["params"]
        == EXPECTED_GROUPS[1]
    )


def test_two_same_shaped_parameters_in_different_groups_are_ambiguous():
    a, b = torch.zeros(3), torch.zeros(3)
    optim = {
        "state": {0: {"m": a}, 1: {"m": b}},
        "param_groups": [{"params": [0]}, {"params": [1]}],
    }
    with pytest.raises(OrderError) as info:
        infer_groups(optim, [Candidate("x", (3,)), Candidate("y", (3,))])
    assert (
        str(info.value)
        == "more than one assignment of the model's tensors fits the optimizer's IDs"
    )


def test_no_fitting_order_is_an_error():
    optim = {"state": {0: {"m": torch.zeros(2)}}, "param_groups": [{"params": [0]}]}
    with pytest.raises(OrderError) as info:
        infer_groups(optim, [Candidate("x", (3,)), Candidate("i", (2,), floating=False)])
    assert str(info.value) == (
        "no order of the model's 2 tensors fits the optimizer's param groups of [1] parameters"
    )


def test_parameters_without_state_yet_keep_their_ids_and_names():
    model, opt = trained("adamw", steps=0)
    model.fc.weight.grad = torch.ones(2, 3)
    opt.step()  # only fc.weight gets state
    by_id, by_fqn = opt.state_dict(), get_state_dict(model, opt)[1]
    assert list(by_id["state"]) == [1]
    assert_trees_equal(fqns_to_ids(by_fqn), by_id)
    assert_trees_equal(ids_to_fqns(by_id, EXPECTED_GROUPS), by_fqn)


def test_dcp_string_ids_are_read_as_ids_and_written_as_ints():
    _, by_id, by_fqn = states("adagrad")
    as_dcp = {**by_id, "state": {str(k): v for k, v in by_id["state"].items()}}
    assert key_type(as_dcp) == "id"
    assert_trees_equal(normalize_ids(as_dcp), by_id)
    assert_trees_equal(ids_to_fqns(as_dcp, EXPECTED_GROUPS), by_fqn)


def test_state_for_a_key_in_no_group_is_inconsistent():
    _, _, by_fqn = states("sgd")
    bad = copy.copy(by_fqn)
    bad["state"] = {**by_fqn["state"], "ghost.weight": {"momentum_buffer": torch.zeros(1)}}
    with pytest.raises(RekeyError) as info:
        fqns_to_ids(bad)
    assert (
        str(info.value) == "optimizer state for 'ghost.weight' names no parameter in param_groups"
    )


def test_drop_removes_tensors_state_and_params_entries_and_renumbers_ids():
    model, by_id, _ = states("adamw")
    tree = {"model": model.state_dict(), "optim": by_id, "scheduler": {"last_epoch": 3}, "step": 9}
    out = rekey(tree, "keep", lambda f, _: None if f.startswith("fc.") else f)
    assert list(out["model"]) == [
        "scale",
        "embed.weight",
        "norm.weight",
        "norm.bias",
        "head.weight",
        "tied.weight",
    ]
    assert [g["params"] for g in out["optim"]["param_groups"]] == [[0, 1], [2, 3]]
    assert list(out["optim"]["state"]) == [0, 1, 2, 3]
    assert out["optim"]["state"][1] is by_id["state"][2]  # head.weight, was ID 2
    assert out["optim"]["state"][2] is by_id["state"][4]  # norm.weight, was ID 4
    assert out["scheduler"] == {"last_epoch": 3} and out["step"] == 9
    assert out["optim"]["param_groups"][1]["lr"] == 0.2


def test_rename_reaches_model_keys_state_keys_and_params_but_not_plain_values():
    model, _, by_fqn = states("sgd")
    tree = {"model": model.state_dict(), "optim": by_fqn, "epoch": 1}
    out = map_fqns(tree, lambda f, _: "net." + f)
    assert list(out["model"])[:2] == ["net.scale", "net.embed.weight"]
    assert list(out["optim"]["state"])[0] == "net.embed.weight"
    assert out["optim"]["param_groups"][0]["params"][0] == "net.embed.weight"
    assert out["epoch"] == 1 and "state" in out["optim"]


@pytest.mark.parametrize(
    ("tree", "where"),
    [
        ({"model": {"a.w": torch.zeros(1)}}, ("model",)),
        ({"ckpt": {"net": {"a.w": torch.zeros(1)}}}, ("ckpt", "net")),
        ({"a.w": torch.zeros(1)}, ()),
    ],
)
@pytest.mark.parametrize("flat", [False, True])
def test_an_optimizers_names_are_told_its_model_tensors_path(tree, where, flat):
    """A rename sees a parameter's state where it sees its tensor (what inspect prints it under)."""
    optim = {"state": {"a.w": {"m": torch.ones(1)}}, "param_groups": [{"lr": 1, "params": ["a.w"]}]}
    if flat:
        optim = {"state.a.w.m": torch.ones(1), "param_groups.a.w.lr": 1}
    parent = tree
    for key in where[:-1]:
        parent = parent[key]
    parent["optim"] = optim
    assert set(fqn_names(tree)) == {("a.w", where)}


def test_a_rename_collision_names_both_keys():
    with pytest.raises(KeyError) as info:
        map_fqns({"model": {"a.w": torch.zeros(1), "b.w": torch.zeros(1)}}, lambda f, _: "w")
    assert info.value.args[0] == ("model.a.w", "model.b.w", "w")


def test_model_params_name_a_tied_parameter_once_under_its_first_name():
    params = params_of(tiny())
    assert params.fqns == (
        "embed.weight",
        "fc.weight",
        "fc.bias",
        "norm.weight",
        "norm.bias",
        "head.weight",
    )
    assert params.shapes[0] == (5, 3)
