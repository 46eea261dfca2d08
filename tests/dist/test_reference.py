"""The reference helpers agree with torch, so product tests can trust them."""

from __future__ import annotations

import pytest
import torch
from harness import RankError, run_ranks
from reference import assert_trees_equal, dcp_to_torch_save_reference, load_dcp_into_fsdp2


@pytest.fixture(scope="module")
def reference(fsdp2_ckpt) -> dict:
    """Return the full reference state saved beside the session checkpoint."""
    return torch.load(fsdp2_ckpt.ref, weights_only=True)


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp2_at_another_world_size_loads_the_reference_checkpoint_exactly(
    fsdp2_ckpt, reference, world_size
):
    assert_trees_equal(load_dcp_into_fsdp2(fsdp2_ckpt.dcp, world_size), reference)


def test_the_reference_has_what_the_product_must_handle(reference):
    model, optim = reference["model"], reference["optim"]
    # The tied weight keeps both FQNs in the model but has one optimizer entry.
    assert torch.equal(model["embed.weight"], model["head.weight"])
    assert "head.weight" not in optim["state"]
    assert "pos_scale" in model and "positions" not in model
    assert {"exp_avg", "exp_avg_sq", "step"} == set(optim["state"]["embed.weight"])
    step = optim["state"]["embed.weight"]["step"]
    assert step.shape == () and step.dtype == torch.float32 and step.item() == 2.0
    assert [g["weight_decay"] for g in optim["param_groups"]] == [0.1, 0.0]
    assert optim["param_groups"][0]["betas"] == (0.9, 0.95)


def test_dcp_to_torch_save_reference_nests_model_and_optim(fsdp2_ckpt, reference, tmp_path):
    out = dcp_to_torch_save_reference(fsdp2_ckpt.dcp, tmp_path / "full.pt")
    converted = torch.load(out, weights_only=False)
    assert_trees_equal(converted["model"], reference["model"])
    assert_trees_equal(converted["optim"]["state"], reference["optim"]["state"])


def test_assert_trees_equal_names_a_single_flipped_element():
    a = {"model": {"w": torch.zeros(7, 3)}}
    b = {"model": {"w": torch.zeros(7, 3)}}
    b["model"]["w"][6, 2] = 1e-30
    with pytest.raises(
        AssertionError, match=r"\['model'\]\['w'\]: 1 of 21 elements differ, first at \(6, 2\)"
    ):
        assert_trees_equal(a, b)


def test_assert_trees_equal_is_bitwise_for_nan_and_signed_zero():
    nan = torch.tensor([float("nan"), 1.0])
    assert_trees_equal({"x": nan, "f": float("nan")}, {"x": nan.clone(), "f": float("nan")})
    with pytest.raises(AssertionError, match=r"\['z'\]"):
        assert_trees_equal({"z": torch.tensor(0.0)}, {"z": torch.tensor(-0.0)})


def test_assert_trees_equal_rejects_tuple_vs_list():
    with pytest.raises(
        AssertionError, match=r"\['betas'\]: tuple \(0.9, 0.95\) vs list \[0.9, 0.95\]"
    ):
        assert_trees_equal({"betas": (0.9, 0.95)}, {"betas": [0.9, 0.95]})


def test_assert_trees_equal_rejects_int_vs_float():
    with pytest.raises(AssertionError, match=r"\[0\]\['step'\]: int 1 vs float 1.0"):
        assert_trees_equal([{"step": 1}], [{"step": 1.0}])


def test_assert_trees_equal_rejects_dtype_and_missing_keys():
    with pytest.raises(AssertionError, match=r"torch.float32\[3\] vs torch.bfloat16\[3\]"):
        assert_trees_equal(torch.zeros(3), torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(AssertionError, match=r"key 'b' only in the second tree"):
        assert_trees_equal({"a": 1}, {"a": 1, "b": 2})


def _raise_on_rank_one() -> int:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("bad shard on purpose")
    dist.barrier()  # rank 0 blocks here forever unless the harness kills it
    return dist.get_rank()


def _abort_on_rank_one() -> None:
    import os
    import signal

    import torch.distributed as dist

    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGABRT)
    dist.barrier()


def _hang_on_rank_one() -> None:
    import time

    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(3600)
    dist.barrier()


def _rank_and_size(offset: int) -> tuple[int, int]:
    import torch.distributed as dist

    return dist.get_rank() + offset, dist.get_world_size()


def test_run_ranks_returns_every_rank_result_in_order():
    assert run_ranks(_rank_and_size, 3, 10) == [(10, 3), (11, 3), (12, 3)]


def test_run_ranks_reports_the_raising_rank_with_its_traceback():
    with pytest.raises(
        RankError, match=r"(?s)rank 1 of 2 raised:.*ValueError: bad shard on purpose"
    ):
        run_ranks(_raise_on_rank_one, 2, timeout=60)


def test_run_ranks_reports_a_rank_killed_by_a_signal():
    with pytest.raises(RankError, match=r"rank 1 of 2 died with signal SIGABRT"):
        run_ranks(_abort_on_rank_one, 2, timeout=60)


def test_run_ranks_kills_ranks_that_outlive_the_timeout():
    with pytest.raises(RankError, match=r"ranks \[0, 1\] of 2 still running after 2 s"):
        run_ranks(_hang_on_rank_one, 2, timeout=2)
