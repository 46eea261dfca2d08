"""torchtitan ``step-N`` directories: detected, inspected part by part, converted to full (as
torch's own ``dcp_to_torch_save``, which torchtitan's docs use) and resharded for torchtitan at 3.

Without torchtitan installed, the directory is built in-process exactly as torchtitan 0.3's
``CheckpointManager`` builds it (``titan_ranks.save_titan_like``) and loaded back as its
loader does; with torchtitan, its own ``CheckpointManager`` saves at 2 and loads at 3.
"""

from __future__ import annotations

import pickle

import pytest
import torch

import titan_ranks
from harness import run_ranks
from reference import assert_trees_equal, dcp_to_torch_save_reference, example
from shardckpt import api
from shardckpt.cli.app import run


@pytest.fixture(scope="module")
def titan_like(tmp_path_factory):
    """Return a step-2 directory saved at 2 ranks as torchtitan saves it, and its truth."""
    step_dir = tmp_path_factory.mktemp("titan") / "checkpoint" / "step-2"
    truth = run_ranks(titan_ranks.save_titan_like, 2, str(step_dir))[0]
    return step_dir, truth


def test_a_torchtitan_step_directory_is_detected_and_inspected_part_by_part(titan_like, capsys):
    insp = api.inspect(api.InspectRequest(src=titan_like[0]))
    assert insp.index.format == "torchtitan"
    parts = {c.name: c for c in insp.components}
    assert list(parts) == ["model", "train_state", "optimizer", "dataloader", "lr_scheduler"]
    assert parts["model"].keys == tuple(example.build_model(0).state_dict())
    assert parts["optimizer"].kind == "optimizer (flat)"
    assert parts["dataloader"].note == (
        "per-rank state of 2 data-parallel ranks (dp_rank_0, dp_rank_1); torchtitan loads it "
        "only at that data-parallel degree"
    )
    assert run(["inspect", str(titan_like[0])]) == 0
    out = capsys.readouterr().out
    assert "torchtitan parts:\n  model: model, 25 tensors at the top level\n" in out
    assert "  optimizer: optimizer (flat)\n" in out
    assert "optimizer optimizer: keys flat, " in out


def test_to_full_gives_every_part_as_torchs_dcp_to_torch_save_does(titan_like, tmp_path):
    src = titan_like[0]
    api.convert(api.ConvertRequest(src=src, dst=tmp_path / "full.pt", to="full"))
    ours = torch.load(tmp_path / "full.pt", weights_only=True)
    torchs = torch.load(dcp_to_torch_save_reference(src, tmp_path / "ref.pt"), weights_only=True)
    assert_trees_equal(ours, torchs)
    assert ours["lr_scheduler"] == {"last_epoch": 2}
    assert sorted(ours["dataloader"]) == ["dp_rank_0", "dp_rank_1", "world_size"]
    assert pickle.loads(ours["dataloader"]["dp_rank_1"])["rank"] == 1


def test_resharded_for_torchtitan_at_three_resumes_bit_exactly(titan_like, tmp_path, capsys):
    src, truth = titan_like
    dst = tmp_path / "checkpoint" / "step-2"
    api.convert(api.ConvertRequest(src=src, dst=dst, to="sharded", format="torchtitan", world_size=3, verify=True))
    assert (
        capsys.readouterr()
        .err.strip()
        .splitlines()
        .count(
            "shardckpt: note: 'dataloader' holds the data loader state of 2 data-parallel ranks, "
            "carried unchanged: torchtitan does not reshard data loaders, so where the "
            "data-parallel degree at 3 ranks differs, resume with "
            "--checkpoint.exclude_from_loading dataloader"
        )
        == 1
    )
    assert api.inspect(api.InspectRequest(src=dst)).index.format == "torchtitan"
    assert not api.diff(api.DiffRequest(a=src, b=dst)).differences
    assert_trees_equal(run_ranks(titan_ranks.load_titan_like, 3, str(dst))[0], truth)


def test_an_hf_export_of_a_torchtitan_step_holds_the_model_alone(titan_like, tmp_path):
    api.convert(api.ConvertRequest(src=titan_like[0], dst=tmp_path / "hf", to="full", format="hf"))
    names = {p[-1] for p, _ in api.inspect(api.InspectRequest(src=tmp_path / "hf")).leaves}
    assert names == set(example.build_model(0).state_dict())


def test_torchtitans_own_checkpoint_manager_resumes_at_three_from_the_conversion(tmp_path):
    pytest.importorskip("torchtitan.components.checkpoint")
    truth = run_ranks(titan_ranks.save_with_torchtitan, 2, str(tmp_path / "run2"))[0]
    src = tmp_path / "run2" / "checkpoint" / f"step-{titan_ranks.STEPS}"
    assert api.inspect(api.InspectRequest(src=src)).index.format == "torchtitan"
    dst = tmp_path / "run3" / "checkpoint" / f"step-{titan_ranks.STEPS}"
    api.convert(api.ConvertRequest(src=src, dst=dst, to="sharded", format="torchtitan", world_size=3))
    loaded = run_ranks(titan_ranks.load_with_torchtitan, 3, str(tmp_path / "run3"))[0]
    assert_trees_equal(loaded, truth)
