"""Acceptance: FSDP1's per-rank LOCAL_STATE_DICT and SHARDED_STATE_DICT files, checked against FSDP1 itself."""

from __future__ import annotations

import shutil

import pytest
import torch

import fsdp1_jobs
import ranks
from harness import run_ranks
from rank_bytes import assert_each_file_holds_only_its_own_bytes
from reference import assert_trees_equal
from shardckpt import api
from shardckpt.errors import BadInputError, UsageError

MODEL = "fsdp1_jobs:build_model"
WRAP = ["fsdp1_jobs:Block"]


@pytest.fixture(scope="module", params=[False, True], ids=["flat", "orig"])
def fsdp1_ckpt(request, tmp_path_factory):
    """FSDP1 at 4 ranks: ``local/`` and ``sharded/`` per-rank files and FSDP1's own full state."""
    root = tmp_path_factory.mktemp(f"fsdp1_{request.param}")
    full = run_ranks(fsdp1_jobs.save, 4, str(root), request.param, timeout=300)[0]
    return root, request.param, full


def test_fsdp1_local_at_4_to_full_equals_fsdp1_full_state_dict(fsdp1_ckpt, tmp_path):
    root, _, full = fsdp1_ckpt
    api.convert(root / "local", tmp_path / "full.pt", to="full", model=MODEL, wraps=WRAP)
    assert_trees_equal(torch.load(tmp_path / "full.pt", weights_only=True), {"model": full["model"]})


def test_full_to_fsdp1_local_at_2_loads_into_fsdp1_at_2(fsdp1_ckpt, tmp_path):
    root, use_orig, full = fsdp1_ckpt
    torch.save({"model": full["model"]}, tmp_path / "full.pt")
    dst = tmp_path / "local2"
    result = api.convert(
        tmp_path / "full.pt",
        dst,
        to="local",
        fmt="fsdp1-local",
        world_size=2,
        model=MODEL,
        wraps=WRAP,
        use_orig_params=use_orig,
        verify=True,
    )
    assert result.verified is True
    assert sorted(p.name for p in dst.iterdir()) == ["rank_0.pt", "rank_1.pt"]
    assert_each_file_holds_only_its_own_bytes(dst)
    loaded = run_ranks(fsdp1_jobs.load_local, 2, str(dst), use_orig)[0]
    assert_trees_equal(loaded, full["model"])


def _fsdp1_full_truth(full: dict, use_orig: bool) -> dict:
    """Return FSDP1's full state; with use_orig_params, FSDP1's FULL optimizer state is wrong.

    torch 2.13's ``FSDP.optim_state_dict`` under FULL_STATE_DICT with
    ``use_orig_params=True`` (gloo, CPU) returns ``exp_avg_sq`` as ``exp_avg``, while
    the SHARDED one holds the optimizer's real ``exp_avg``. So there only the model
    and the other state are compared; the check below fails once torch fixes it.
    """
    if not use_orig:
        return full
    for state in full["optim"]["state"].values():
        assert torch.equal(state["exp_avg"], state["exp_avg_sq"])
    return full


def _without_exp_avg(tree: dict) -> dict:
    optim = tree["optim"]
    state = {k: {n: v for n, v in s.items() if n != "exp_avg"} for k, s in optim["state"].items()}
    return {**tree, "optim": {**optim, "state": state}}


def test_fsdp1_sharded_at_4_to_full_matches_fsdp1_full_state(fsdp1_ckpt, tmp_path):
    root, use_orig, full = fsdp1_ckpt
    api.convert(root / "sharded", tmp_path / "full.pt", to="full")
    out = torch.load(tmp_path / "full.pt", weights_only=True)
    truth = _fsdp1_full_truth(full, use_orig)
    if use_orig:
        out, truth = _without_exp_avg(out), _without_exp_avg(truth)
    assert_trees_equal(out, truth)


def test_fsdp1_sharded_at_4_to_dcp_at_2_matches_fsdp1_full_state(fsdp1_ckpt, tmp_path):
    root, use_orig, full = fsdp1_ckpt
    api.convert(root / "sharded", tmp_path / "dcp", to="sharded", world_size=2)
    assert sorted(p.name for p in (tmp_path / "dcp").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    api.convert(tmp_path / "dcp", tmp_path / "back.pt", to="full")
    out = torch.load(tmp_path / "back.pt", weights_only=True)
    truth = _fsdp1_full_truth(full, use_orig)
    if use_orig:
        out, truth = _without_exp_avg(out), _without_exp_avg(truth)
    assert_trees_equal(out, truth)


def test_fsdp1_sharded_written_at_2_loads_into_fsdp1_at_2(fsdp1_ckpt, tmp_path):
    root, use_orig, full = fsdp1_ckpt
    if use_orig:
        pytest.skip("FSDP1's own FULL optimizer state is wrong with use_orig_params (see above)")
    dst = tmp_path / "sharded2"
    result = api.convert(
        root / "sharded", dst, to="local", fmt="fsdp1-sharded", world_size=2, verify=True
    )
    assert result.verified is True
    assert_trees_equal(run_ranks(fsdp1_jobs.load_sharded, 2, str(dst))[0], full)


@pytest.mark.parametrize("kind", ["local", "sharded"])
def test_two_ranks_write_the_same_bytes_as_one(fsdp1_ckpt, tmp_path, kind):
    root, use_orig, _ = fsdp1_ckpt
    opts = {"model": MODEL, "wraps": WRAP} if kind == "local" else {}
    local = {"fmt": f"fsdp1-{kind}", "world_size": 3}
    if kind == "local":
        local["use_orig_params"] = use_orig
    for name, to, extra in [
        ("full.pt", "full", {}),
        ("dcp", "sharded", {"world_size": 3}),
        ("local", "local", local),
    ]:
        one, two = tmp_path / "one" / name, tmp_path / "two" / name
        one.parent.mkdir(exist_ok=True)
        two.parent.mkdir(exist_ok=True)
        api.convert(root / kind, one, to=to, **opts, **extra)
        run_ranks(ranks.convert, 2, str(root / kind), str(two), to, {**opts, **extra})
        files = sorted(p.name for p in one.iterdir()) if one.is_dir() else [""]
        assert files == (sorted(p.name for p in two.iterdir()) if two.is_dir() else [""])
        # DCP's .metadata records where it was saved; its content is compared by diff.
        for f in (f for f in files if f != ".metadata"):
            assert (one / f).read_bytes() == (two / f).read_bytes(), (name, f)
        if to != "local":
            assert api.diff(one, two).equal


def test_missing_rank_file_is_one_line(fsdp1_ckpt, tmp_path):
    root, _, _ = fsdp1_ckpt
    src = tmp_path / "sharded"
    shutil.copytree(root / "sharded", src)
    (src / "rank_2.pt").unlink()
    with pytest.raises(BadInputError) as err:
        api.convert(src, tmp_path / "out.pt", to="full", src_format="fsdp1-sharded")
    assert err.value.line() == (
        f"'{src}': no file for rank 2 of 4 (rank_2.pt): copy every rank's file of the checkpoint"
    )


def test_mixed_world_sizes_are_one_line(fsdp1_ckpt, tmp_path):
    root, _, _ = fsdp1_ckpt
    src = tmp_path / "mixed"
    api.convert(root / "sharded", src, to="local", fmt="fsdp1-sharded", world_size=2)
    for r in (2, 3):
        shutil.copy(root / "sharded" / f"rank_{r}.pt", src / f"rank_{r}.pt")
    with pytest.raises(BadInputError) as err:
        api.convert(src, tmp_path / "out.pt", to="full")
    assert err.value.line() == (
        f"'{src}': 'model.embed.weight' was saved by a job of 2 ranks, but the directory "
        "holds files of 4 ranks: keep only one checkpoint's rank files in the directory"
    )


def test_fsdp1_local_files_with_optimizer_state_are_refused_in_one_line(fsdp1_ckpt, tmp_path):
    root, _, full = fsdp1_ckpt
    src = root / "local_optim"
    with pytest.raises(BadInputError) as err:
        api.convert(src, tmp_path / "out.pt", to="full", model=MODEL, wraps=WRAP)
    assert err.value.line() == (
        f"'{src / 'rank_0.pt'}': holds optimizer state, which FSDP1's LOCAL_STATE_DICT cannot "
        "describe: convert with --only model, or save the optimizer with FSDP.optim_state_dict "
        "as fsdp1-sharded"
    )
    api.convert(src, tmp_path / "model.pt", to="full", only="model", model=MODEL, wraps=WRAP)
    assert_trees_equal(torch.load(tmp_path / "model.pt", weights_only=True), {"model": full["model"]})


def test_fsdp1_local_without_model_is_a_usage_error(fsdp1_ckpt, tmp_path):
    root, _, _ = fsdp1_ckpt
    with pytest.raises(UsageError) as err:
        api.convert(root / "local", tmp_path / "out.pt", to="full")
    assert err.value.line() == (
        f"'{root / 'local'}': fsdp1-local flat parameters need the model to be read: "
        "pass --model pkg.module:factory and the --wrap classes training wrapped"
    )
    assert err.value.exit_code == 2
