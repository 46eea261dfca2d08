"""Acceptance: optimizer state moves between plain torch.optim (param IDs) and FSDP/DCP (FQNs),
checked against torch itself: set_state_dict, FSDP2 loads and FSDP1's rekey_optim_state_dict."""

from __future__ import annotations

import optim_ranks
import pytest
import ranks
import torch
from harness import run_ranks
from reference import assert_trees_equal, example, load_dcp_into_fsdp2
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from shardckpt import api
from shardckpt.state.model import params_of
from shardckpt.state.optim import fqns_to_ids, groups_from_model, ids_to_fqns, rekey
from shardckpt.core.errors import UsageError
from shardckpt.state.model import params_of
from shardckpt.state.optim import fqns_to_ids, groups_from_model, ids_to_fqns, rekey

MODEL = "optim_models:tinylm_with_groups"


@pytest.fixture(scope="module")
def ref(fsdp2_ckpt):
    return torch.load(fsdp2_ckpt.ref, weights_only=True)


def plain_model_and_optimizer(num_blocks: int = 2):
    """Return the example model, unwrapped, from another seed, and AdamW over its groups."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        model = example.TinyLM(num_blocks)
    return model, example.build_optimizer(model)


def test_fsdp2_dcp_to_full_with_param_ids_loads_into_a_plain_adamw(fsdp2_ckpt, ref, tmp_path):
    api.convert(api.ConvertRequest(src=fsdp2_ckpt.dcp, dst=tmp_path / "plain.pt", to="full", optim_keys="id"))
    out = torch.load(tmp_path / "plain.pt", weights_only=True)
    model, optimizer = plain_model_and_optimizer()
    model.load_state_dict(out["model"])
    optimizer.load_state_dict(out["optim"])
    # What plain torch.optim holds after torch itself loads the FQN-keyed values.
    ref_model, ref_optimizer = plain_model_and_optimizer()
    set_state_dict(
        ref_model, ref_optimizer, model_state_dict=ref["model"], optim_state_dict=ref["optim"]
    )
    assert_trees_equal(optimizer.state_dict(), ref_optimizer.state_dict())
    assert_trees_equal(out["optim"], ref_optimizer.state_dict())
    assert_trees_equal(model.state_dict(), ref_model.state_dict())


@pytest.fixture(scope="module")
def ddp_ckpt(tmp_path_factory):
    """A torch.save from DDP over a compile-style wrapper: module._orig_mod. keys, param IDs."""
    path = tmp_path_factory.mktemp("ddp") / "ddp.pt"
    truth = run_ranks(optim_ranks.ddp_checkpoint, 2, str(path))[0]
    return path, truth


def test_ddp_checkpoint_has_wrapper_prefixes_and_param_ids(ddp_ckpt):
    raw = torch.load(ddp_ckpt[0], weights_only=True)
    assert "module._orig_mod.embed.weight" in raw["model"]
    assert raw["optim"]["param_groups"][0]["params"][:2] == [0, 1]


@pytest.mark.parametrize("model", [MODEL, None], ids=["model", "inferred"])
def test_ddp_checkpoint_to_sharded_fqn_keys_loads_into_fsdp2_at_two(ddp_ckpt, tmp_path, model):
    # Without --model the ID order is inferred from the model state, and for this model it
    # is unambiguous (shapes and order pin every ID), so this pins "works from inference".
    src, truth = ddp_ckpt
    dst = tmp_path / "sharded"
    kwargs = {"optim_keys": "fqn", "model": model, "world_size": 2}
    run_ranks(ranks.convert, 2, str(src), str(dst), "sharded", kwargs)
    assert_trees_equal(load_dcp_into_fsdp2(dst, 2), truth)


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_rekeying_equals_fsdp1_rekey_optim_state_dict_both_ways(use_orig_params):
    torch_says = run_ranks(optim_ranks.fsdp1_rekey, 1, use_orig_params)[0]
    plain = example.build_model(0)
    groups = example.param_groups(plain) if use_orig_params else None
    model = params_of(plain, groups)
    full, by_id, by_name = torch_says["full"], torch_says["by_id"], torch_says["by_name"]

    assert_trees_equal(fqns_to_ids(full, model), by_id)
    ours = ids_to_fqns(by_id, groups_from_model(by_id, model))
    # torch sorts each group's FQNs by name; the state itself must be the same.
    assert_trees_equal(ours["state"], by_name["state"])
    assert [sorted(g["params"]) for g in ours["param_groups"]] == [
        g["params"] for g in by_name["param_groups"]
    ]
    # And from the checkpoint alone: the model state beside the optimizer gives the order.
    inferred = rekey({"model": plain.state_dict(), "optim": by_id}, "fqn")["optim"]
    assert_trees_equal(inferred, ours)


def test_drop_removes_a_block_and_the_result_loads_into_the_model_without_it(
    fsdp2_ckpt, ref, tmp_path
):
    api.convert(api.ConvertRequest(src=fsdp2_ckpt.dcp, dst=tmp_path / "one.pt", to="full", optim_keys="id", edits=[("--drop", r"^blocks\.1\.")]))
    out = torch.load(tmp_path / "one.pt", weights_only=True)
    model, optimizer = plain_model_and_optimizer(num_blocks=1)
    model.load_state_dict(out["model"])  # strict: nothing missing, nothing extra
    optimizer.load_state_dict(out["optim"])
    msd, osd = get_state_dict(model, optimizer)
    kept = [k for k in ref["model"] if not k.startswith("blocks.1.")]
    assert_trees_equal(msd, {k: ref["model"][k] for k in kept})
    expected = {
        "state": {k: v for k, v in ref["optim"]["state"].items() if not k.startswith("blocks.1.")},
        "param_groups": [
            {**g, "params": [p for p in g["params"] if not p.startswith("blocks.1.")]}
            for g in ref["optim"]["param_groups"]
        ],
    }
    assert_trees_equal(osd, expected)


@pytest.fixture(scope="module")
def ddp_named_ckpt(tmp_path_factory):
    """A torch.save from DDP whose optimizer was built from named_parameters() (param_names)."""
    path = tmp_path_factory.mktemp("ddp-named") / "ddp.pt"
    truth = run_ranks(optim_ranks.ddp_named_checkpoint, 2, str(path))[0]
    return path, truth


def test_stored_param_names_rekey_a_ddp_save_that_resumes_fsdp2_without_model(
    ddp_named_ckpt, tmp_path
):
    src, truth = ddp_named_ckpt
    raw = torch.load(src, weights_only=True)
    assert raw["optim"]["param_groups"][0]["param_names"][0].startswith("module.")
    dst = tmp_path / "sharded"
    kwargs = {"optim_keys": "fqn", "world_size": 2}
    run_ranks(ranks.convert, 2, str(src), str(dst), "sharded", kwargs)
    assert_trees_equal(load_dcp_into_fsdp2(dst, 2, optim_ranks.named_optimizer), truth)


def test_without_stored_names_the_same_save_asks_for_model(ddp_named_ckpt, tmp_path):
    src, _ = ddp_named_ckpt
    raw = torch.load(src, weights_only=True)
    for group in raw["optim"]["param_groups"]:
        del group["param_names"]
    torch.save(raw, tmp_path / "unnamed.pt")
    with pytest.raises(UsageError, match="no order of the model's .* tensors fits"):
        api.convert(api.ConvertRequest(src=tmp_path / "unnamed.pt", dst=tmp_path / "out", to="sharded", optim_keys="fqn", world_size=2))
