"""Optimizers built from ``named_parameters()`` carry their names: rekeyed from them, no --model."""

from __future__ import annotations

import pytest
import torch
from optim_models import tiny
from reference import assert_trees_equal
from torch.distributed.checkpoint.state_dict import get_state_dict

from shardckpt.cli.render import inspection_json, inspection_text
from shardckpt.core.errors import BadInputError, UsageError
from shardckpt.formats.base import Index
from shardckpt.plan.selection import Selection, select
from shardckpt.state.optim import RekeyError, rekey, stored_names
from shardckpt.state.tree import describe_optimizer


def _trained(named: bool, prefix: str = ""):
    """Return (model, optimizer) after one AdamW step, groups listed against model order.

    The vectors' group comes first and each group lists its parameters backwards, so
    no order of the model's tensors fits the groups: only the names can tell IDs apart.
    """
    model = tiny()
    pairs = [(prefix + n, p) for n, p in model.named_parameters()]
    vectors = [(n, p) for n, p in reversed(pairs) if p.ndim < 2]
    matrices = [(n, p) for n, p in reversed(pairs) if p.ndim >= 2]

    def listed(group):
        return group if named else [p for _, p in group]

    opt = torch.optim.AdamW(
        [{"params": listed(vectors), "lr": 0.2}, {"params": listed(matrices), "lr": 0.1}]
    )
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    opt.step()
    return model, opt


def _tree(model, opt) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def test_names_key_the_state_as_get_state_dict_does():
    model, opt = _trained(named=True)
    by_fqn = rekey(_tree(model, opt), "fqn")["optim"]
    expected = get_state_dict(model, opt)[1]
    assert_trees_equal(by_fqn["state"], expected["state"])
    assert [g["params"] for g in by_fqn["param_groups"]] == [
        g["params"] for g in expected["param_groups"]
    ]
    assert [g["param_names"] for g in by_fqn["param_groups"]] == [
        g["params"] for g in expected["param_groups"]
    ]


def test_without_names_the_same_groups_cannot_be_told():
    model, opt = _trained(named=False)
    index = Index("torch", "ckpt.pt", 1, _tree(model, opt))
    with pytest.raises(UsageError, match="no order of the model's"):
        select(index, Selection(optim_keys="fqn"))


def test_names_need_no_model_state_beside_the_optimizer():
    model, opt = _trained(named=True)
    out = rekey({"optim": opt.state_dict()}, "fqn")["optim"]
    assert list(out["state"]) == [
        n for g in opt.state_dict()["param_groups"] for n in g["param_names"]
    ]


def test_a_ddp_prefix_is_cleaned_from_the_names_as_from_the_keys():
    model, opt = _trained(named=True, prefix="module.")
    tree = {
        "model": {f"module.{k}": v for k, v in model.state_dict().items()},
        "optim": opt.state_dict(),
    }
    out = select(Index("torch", "ckpt.pt", 1, tree), Selection(optim_keys="fqn"))
    names = [n for g in out["optim"]["param_groups"] for n in g["param_names"]]
    assert list(out["optim"]["state"]) == names
    assert not any(n.startswith("module.") for n in names)


def test_a_drop_keeps_each_name_beside_its_id():
    model, opt = _trained(named=True)
    out = rekey(_tree(model, opt), "id", fqn_map=lambda f, _: None if f == "fc.bias" else f)
    for group in out["optim"]["param_groups"]:
        assert len(group["param_names"]) == len(group["params"])
        assert "fc.bias" not in group["param_names"]
    assert rekey(out, "fqn")["optim"]["param_groups"][0]["params"] == [
        n for n in reversed(["fc.bias", "norm.weight", "norm.bias"]) if n != "fc.bias"
    ]


def test_names_that_do_not_line_up_with_the_ids_are_refused():
    model, opt = _trained(named=True)
    sd = opt.state_dict()
    sd["param_groups"][0]["param_names"] = sd["param_groups"][0]["param_names"][:-1]
    with pytest.raises(RekeyError, match="param group 0 lists 3 params but 2 param_names"):
        stored_names(sd)
    index = Index("torch", "ckpt.pt", 1, {"model": model.state_dict(), "optim": sd})
    with pytest.raises(BadInputError, match="inconsistent optimizer state"):
        select(index, Selection(optim_keys="fqn"))


def test_inspect_says_the_names_are_stored():
    from shardckpt.api import Inspection

    for named in (True, False):
        model, opt = _trained(named=named)
        tree = _tree(model, opt)
        info = describe_optimizer(tree, ("optim",))
        assert info.param_names is named
        insp = Inspection(Index("torch", "ckpt.pt", 1, tree), [], [info])
        assert inspection_json(insp)["optimizers"][0]["param_names"] is named
        assert ("param names stored" in inspection_text(insp)) is named
