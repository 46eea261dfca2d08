"""``--nest KEY`` / ``--unnest KEY`` (and diff's ``--nest-a`` ...): trees rooted elsewhere (issue 11)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from shardckpt import api
from shardckpt.cli.app import run
from shardckpt.core.errors import UsageError
from shardckpt.formats.base import Index
from shardckpt.plan.selection import Selection, select
from shardckpt.state.tree import TensorMeta

W = TensorMeta("w", (7, 3), torch.float32)
B = TensorMeta("b", (7,), torch.float32)
OPTIM = {"state": {}, "param_groups": [{"lr": 0.1, "params": ["fc.w"]}]}


def index(tree: dict) -> Index:
    return Index("torch", "src.pt", 1, tree)


def test_nest_puts_the_selected_tree_under_the_key():
    tree = select(index({"fc.w": W, "fc.b": B}), Selection(nest="model"))
    assert tree == {"model": {"fc.w": W, "fc.b": B}}


def test_unnest_makes_the_subtree_the_root():
    assert select(index({"model": {"fc.w": W}}), Selection(unnest="model")) == {"fc.w": W}


def test_filters_name_paths_as_src_has_them_and_unnest_then_nest_re_roots():
    src = index({"state_dict": {"fc.w": W, "fc.b": B}, "epoch": 3, "optim": OPTIM})
    selection = Selection(filters=("state_dict.*",), unnest="state_dict", nest="model")
    assert select(src, selection) == {"model": {"fc.w": W, "fc.b": B}}


def error(tree: dict, **kwargs) -> str:
    with pytest.raises(UsageError) as info:
        select(index(tree), Selection(**kwargs))
    return info.value.line()


def test_unnest_refuses_to_drop_the_other_top_level_keys_and_names_them():
    assert error({"model": {"fc.w": W}, "optim": OPTIM, "step": 2}, unnest="model") == (
        "'src.pt': --unnest model would leave out the other top-level keys beside it: "
        "'optim', 'step': select 'model' alone first, e.g. --filter 'model.*' (or --only model)"
    )


def test_unnest_of_a_missing_key_names_the_keys_there_are():
    assert error({"model": {"fc.w": W}, "step": 2}, unnest="state_dict") == (
        "'src.pt': --unnest state_dict: the selected tree has no top-level 'state_dict' "
        "(it has 'model', 'step'): pass one of its top-level keys (`shardckpt inspect` shows them)"
    )


def test_unnest_of_a_leaf_is_refused():
    assert error({"w": W}, unnest="w") == (
        "'src.pt': --unnest w: 'w' is a tensor, not a subtree: pass a top-level key that "
        "holds a dict"
    )


def test_diff_names_its_own_options():
    assert error({"model": {"fc.w": W}, "step": 2}, unnest="model", side="-b").startswith(
        "'src.pt': --unnest-b model would leave out"
    )
    with pytest.raises(UsageError, match="--nest-a needs a key"):
        Selection(nest="", side="-a")


def build() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 7), nn.ReLU(), nn.Linear(7, 5))


def test_a_flat_state_dict_nested_under_model_loads_with_dcp_load(tmp_path):
    """A bare ``model.state_dict()`` file becomes the ``{"model": ...}`` DCP that loaders expect."""
    trained = build()
    torch.save(trained.state_dict(), tmp_path / "flat.pt")
    api.convert(
        api.ConvertRequest(
            src=tmp_path / "flat.pt",
            dst=tmp_path / "dcp",
            to="sharded",
            world_size=3,
            nest="model",
            verify=True,
        )
    )
    fresh = nn.Sequential(nn.Linear(3, 7), nn.ReLU(), nn.Linear(7, 5))
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=tmp_path / "dcp")
    fresh.load_state_dict(state["model"])
    for name, value in trained.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name
    # Without --nest the same loader misses every key.
    api.convert(
        api.ConvertRequest(
            src=tmp_path / "flat.pt", dst=tmp_path / "bare", to="sharded", world_size=3
        )
    )
    with pytest.raises(CheckpointException) as info:
        dcp.load({"model": fresh.state_dict()}, checkpoint_id=tmp_path / "bare")
    assert "Missing key in checkpoint state_dict: model.0.weight" in str(info.value)


def test_diff_compares_a_flat_file_with_its_nested_dcp(tmp_path, capsys):
    torch.save(build().state_dict(), tmp_path / "flat.pt")
    api.convert(
        api.ConvertRequest(
            src=tmp_path / "flat.pt", dst=tmp_path / "dcp", to="sharded", world_size=2, nest="model"
        )
    )
    a, b = str(tmp_path / "flat.pt"), str(tmp_path / "dcp")
    assert run(["diff", a, b, "-q"]) == 1
    assert run(["diff", a, b, "-q", "--nest-a", "model"]) == 0
    assert run(["diff", a, b, "-q", "--unnest-b", "model"]) == 0
    assert run(["diff", b, a, "-q", "--unnest-a", "model"]) == 0
