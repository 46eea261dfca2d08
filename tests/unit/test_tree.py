"""Checkpoint trees: DCP-compatible paths, rebuilding, pruning, optimizers, FQN cleaning."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from shardckpt.state.tree import (
    build,
    clean_fqn,
    describe_optimizer,
    find_optimizers,
    map_leaves,
    prune,
    rename_keys,
    split_model_optim,
    walk,
)


def sample() -> dict:
    return {
        "model": {"layers.0.weight": torch.zeros(7, 3), "buf": torch.ones(2)},
        "optim": {
            "state": {"layers.0.weight": {"step": torch.tensor(1.0), "exp_avg": torch.zeros(7, 3)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["layers.0.weight"]}],
        },
        "extra": [torch.zeros(1), {"epoch": 3}],
        "steps": [1, 2, 3],
    }


def test_walk_paths_are_the_ones_dcp_flattening_records():
    tree = sample()
    _, mappings = flatten_state_dict(tree)
    assert [p for p, _ in walk(tree)] == list(mappings.values())


def test_build_from_walked_leaves_gives_back_the_tree_dcp_style():
    tree = sample()
    rebuilt = build(list(walk(tree)))
    assert list(walk(rebuilt)) == list(walk(tree))
    assert isinstance(rebuilt["extra"], list) and rebuilt["steps"] == [1, 2, 3]


def test_map_leaves_keeps_containers_and_value_types():
    tree = sample()
    out = map_leaves(tree, lambda p, leaf: leaf.shape if isinstance(leaf, torch.Tensor) else leaf)
    assert out["optim"]["param_groups"][0]["betas"] == (0.9, 0.99)
    assert out["model"]["layers.0.weight"] == torch.Size([7, 3])
    assert out["extra"][1] == {"epoch": 3}


def test_prune_drops_rejected_leaves_and_emptied_containers():
    out = prune(sample(), lambda p, _: p[0] == "model")
    assert list(out) == ["model"]
    assert list(out["model"]) == ["layers.0.weight", "buf"]


def test_optimizer_subtrees_are_found_and_described():
    tree = sample()
    assert find_optimizers(tree) == [("optim",)]
    info = describe_optimizer(tree, ("optim",))
    assert (info.key_type, info.num_params, info.state_names, info.num_groups) == (
        "fqn",
        1,
        ("exp_avg", "step"),
        1,
    )
    tree["optim"]["state"] = {0: {"step": torch.tensor(1.0)}}
    tree["optim"]["param_groups"][0]["params"] = [0]
    assert describe_optimizer(tree, ("optim",)).key_type == "id"


def test_only_model_or_optim_splits_the_top_level():
    tree = sample()
    assert list(split_model_optim(tree, "model")) == ["model", "extra", "steps"]
    assert list(split_model_optim(tree, "optim")) == ["optim"]


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        ("module._orig_mod.layers.0._fsdp_wrapped_module.weight", "layers.0.weight"),
        ("layers.0._checkpoint_wrapped_module.mlp.weight", "layers.0.mlp.weight"),
        ("module.weight", "weight"),
        ("layers.module.weight", "layers.module.weight"),
    ],
)
def test_clean_fqn_strips_wrapper_parts(raw, clean):
    assert clean_fqn(raw) == clean


def test_rename_keys_reaches_state_keys_and_param_group_params():
    tree = {
        "optim": {"state": {"module.w": {}}, "param_groups": [{"params": ["module.w"], "lr": 1}]}
    }
    out = rename_keys(tree, clean_fqn)
    assert out == {"optim": {"state": {"w": {}}, "param_groups": [{"params": ["w"], "lr": 1}]}}


def test_rename_keys_reports_a_collision():
    with pytest.raises(KeyError) as info:
        rename_keys({"model": {"module.w": 1, "w": 2}}, clean_fqn)
    assert info.value.args[0] == ("model.module.w", "model.w", "w")


def test_an_empty_mapping_below_the_root_is_a_leaf_so_no_traversal_loses_it():
    tree = {"a": {}, "optim": {"state": {}, "param_groups": [{"lr": 0.1, "params": []}]}}
    assert list(walk(tree)) == [
        (("a",), {}),
        (("optim", "state"), {}),
        (("optim", "param_groups", 0, "lr"), 0.1),
        (("optim", "param_groups", 0, "params"), []),
    ]
    assert map_leaves(tree, lambda _p, leaf: leaf) == tree
    assert build(list(walk(tree))) == tree
    # A filter keeps or drops an empty mapping like any other leaf.
    assert prune(tree, lambda p, _: p[0] == "a") == {"a": {}}
    assert prune(tree, lambda p, _: p[0] != "a") == {k: v for k, v in tree.items() if k != "a"}
    assert list(walk({})) == []
