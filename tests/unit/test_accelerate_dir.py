"""The accelerate directory's parts, on directories laid out as ``save_state`` lays them out.

The parts are saved here with torch's own ``dcp.save`` and ``torch.save``, in one process;
tests/dist/test_accelerate.py saves and loads with accelerate itself.
"""

from __future__ import annotations

import collections
import pickle
import warnings

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from shardckpt import api
from shardckpt.cli.app import run
from shardckpt.formats import detect
from shardckpt.formats.trainers.accelerate import world_size_note


def _dcp(path, state: dict) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path), no_dist=True)


def _model(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"fc.weight": torch.randn(7, 3, generator=g), "fc.bias": torch.randn(7, generator=g)}


def _optimizer() -> dict:
    state = {
        fqn: {"step": torch.tensor(2.0), "exp_avg": torch.ones(s)}
        for fqn, s in (("fc.weight", (7, 3)), ("fc.bias", (7,)))
    }
    return {"state": state, "param_groups": [{"lr": 0.1, "params": ["fc.weight", "fc.bias"]}]}


@pytest.fixture
def saved(tmp_path):
    """Return a directory laid out as accelerate's FSDP SHARDED_STATE_DICT ``save_state``."""
    root = tmp_path / "checkpoint_0"
    root.mkdir()
    _dcp(root / "pytorch_model_fsdp_0", {"model": _model()})
    _dcp(root / "optimizer_0", {"optimizer": _optimizer()})
    torch.save({"last_epoch": 2, "_last_lr": [0.05]}, root / "scheduler.bin")
    for rank in (0, 1):
        torch.save(
            {"step": 2, "numpy_random_seed": np.random.get_state()},
            root / f"random_states_{rank}.pkl",
        )
    return root


def test_a_save_state_directory_is_detected_and_read_as_one_tree(saved):
    assert detect(saved) == "accelerate"
    insp = api.inspect(api.InspectRequest(src=saved))
    assert list(insp.index.tree) == ["model", "optimizer", "scheduler"]
    assert insp.index.tree["scheduler"] == {"last_epoch": 2, "_last_lr": [0.05]}
    assert [(p.file, p.key) for p in insp.index.parts] == [
        ("pytorch_model_fsdp_0", "model"),
        ("optimizer_0", "optimizer"),
        ("scheduler.bin", "scheduler"),
        ("random_states_0.pkl", None),
        ("random_states_1.pkl", None),
    ]


def test_a_scheduler_that_is_a_pickled_object_is_carried_unread_and_copied(saved, tmp_path):
    (saved / "scheduler.bin").unlink()
    torch.save(
        {"last_epoch": 2, "order": collections.OrderedDict(a=1), "x": np.float64(1)},
        saved / "scheduler.bin",
    )
    insp = api.inspect(api.InspectRequest(src=saved))
    assert "scheduler" not in insp.index.tree
    note = next(p.note for p in insp.index.parts if p.file == "scheduler.bin")
    assert note.startswith("not read: refused to unpickle")
    dst = tmp_path / "at3"
    assert (
        run(
            [
                "convert",
                str(saved),
                str(dst),
                "--to",
                "sharded",
                "--format",
                "accelerate",
                "--world-size",
                "3",
            ]
        )
        == 0
    )
    assert (dst / "scheduler.bin").read_bytes() == (saved / "scheduler.bin").read_bytes()


def test_an_unknown_directory_is_carried_and_copied_whole(saved, tmp_path):
    (saved / "logs").mkdir()
    (saved / "logs" / "events.txt").write_text("step 2\n")
    insp = api.inspect(api.InspectRequest(src=saved))
    assert [(p.file, p.note) for p in insp.index.parts if p.file == "logs"] == [
        ("logs", "a directory save_state does not write")
    ]
    dst = tmp_path / "at1"
    assert (
        run(
            [
                "convert",
                str(saved),
                str(dst),
                "--to",
                "sharded",
                "--format",
                "accelerate",
                "--world-size",
                "1",
                "--verify",
            ]
        )
        == 0
    )
    assert (dst / "logs" / "events.txt").read_text() == "step 2\n"
    assert run(["diff", str(saved), str(dst)]) == 0


def test_per_rank_files_of_use_dcp_false_are_refused_in_one_line(saved, capsys):
    torch.save(_model(), saved / "pytorch_model_fsdp_0_rank0.bin")
    assert run(["inspect", str(saved)]) == 3
    assert capsys.readouterr().err == (
        f"shardckpt: error: '{saved / 'pytorch_model_fsdp_0_rank0.bin'}': is a per-rank file of "
        "accelerate's use_dcp=False or LOCAL_STATE_DICT save, which shardckpt does not read: "
        "save with SHARDED_STATE_DICT (use_dcp=True) or FULL_STATE_DICT\n"
    )


def test_a_directory_with_no_model_is_refused_naming_what_it_lacks(tmp_path, capsys):
    torch.save({"step": 1}, tmp_path / "random_states_0.pkl")
    assert run(["inspect", str(tmp_path)]) == 3
    assert capsys.readouterr().err == (
        f"shardckpt: error: '{tmp_path}': holds no model (pytorch_model_fsdp_0/, "
        "pytorch_model_fsdp.bin or model.safetensors): pass the directory "
        "Accelerator.save_state wrote, or --from another format\n"
    )


def test_a_model_dcp_not_nested_as_accelerate_nests_it_is_refused(saved, capsys):
    _dcp(saved / "pytorch_model_fsdp_1", {"weights": _model()})
    assert run(["inspect", str(saved)]) == 3
    assert capsys.readouterr().err == (
        f"shardckpt: error: '{saved / 'pytorch_model_fsdp_1'}': holds ['weights'] at the top, "
        "where the trainer saves one key 'model': this directory was not written by the "
        "trainer it looks like; convert its parts one by one\n"
    )


def test_second_models_and_optimizers_keep_their_index(saved, tmp_path):
    _dcp(saved / "pytorch_model_fsdp_1", {"model": _model(1)})
    torch.save(_optimizer(), saved / "optimizer_1.bin")
    insp = api.inspect(api.InspectRequest(src=saved))
    assert list(insp.index.tree) == ["model", "model_1", "optimizer", "optimizer_1", "scheduler"]
    dst = tmp_path / "at2"
    assert (
        run(
            [
                "convert",
                str(saved),
                str(dst),
                "--to",
                "sharded",
                "--format",
                "accelerate",
                "--world-size",
                "2",
                "--verify",
            ]
        )
        == 0
    )
    assert sorted(p.name for p in dst.iterdir()) == [
        "optimizer_0",
        "optimizer_1",
        "pytorch_model_fsdp_0",
        "pytorch_model_fsdp_1",
        "random_states_0.pkl",
        "random_states_1.pkl",
        "scheduler.bin",
    ]


def test_a_dcp_of_model_and_optim_becomes_an_accelerate_directory(tmp_path):
    _dcp(tmp_path / "dcp", {"model": _model(), "optim": _optimizer()})
    dst = tmp_path / "acc"
    assert (
        run(
            [
                "convert",
                str(tmp_path / "dcp"),
                str(dst),
                "--to",
                "sharded",
                "--format",
                "accelerate",
                "--world-size",
                "2",
            ]
        )
        == 0
    )
    assert sorted(p.name for p in dst.iterdir()) == ["optimizer_0", "pytorch_model_fsdp_0"]
    assert list(api.inspect(api.InspectRequest(src=dst)).index.tree) == ["model", "optimizer"]
    assert run(["diff", str(tmp_path / "dcp"), str(dst), "--only", "model"]) == 0


def test_a_top_level_key_accelerate_has_no_place_for_is_refused(tmp_path, capsys):
    _dcp(tmp_path / "dcp", {"model": _model(), "epoch": 3})
    argv = [
        "convert",
        str(tmp_path / "dcp"),
        str(tmp_path / "acc"),
        "--to",
        "sharded",
        "--format",
        "accelerate",
    ]
    assert run([*argv, "--world-size", "2"]) == 2
    assert capsys.readouterr().err == (
        "shardckpt: error: --format accelerate holds models, optimizers and the files of an "
        "accelerate directory, and top-level key 'epoch' is none of them: --filter it out, "
        "or write --format dcp\n"
    )


def test_the_rng_pickles_are_never_unpickled(saved):
    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('unpickled')",))

    (saved / "random_states_1.pkl").write_bytes(pickle.dumps(Boom()))
    assert api.inspect(api.InspectRequest(src=saved, trust_pickle=True)).index.world_size == 1


def test_two_files_holding_one_part_are_refused_naming_both(saved, capsys):
    torch.save(_model(), saved / "pytorch_model_fsdp.bin")
    assert run(["inspect", str(saved)]) == 3
    assert capsys.readouterr().err == (
        f"shardckpt: error: '{saved}': both 'pytorch_model_fsdp.bin' and "
        "'pytorch_model_fsdp_0' hold its 'model': keep the one the job saved last (move the "
        "other away), or convert each on its own\n"
    )


def test_a_model_directory_whose_save_did_not_finish_is_named(saved, capsys):
    (saved / "optimizer_0" / ".metadata").unlink()
    assert run(["inspect", str(saved)]) == 3
    assert capsys.readouterr().err.startswith(
        f"shardckpt: error: '{saved / 'optimizer_0'}': no '.metadata' in this directory"
    )


def test_the_note_names_rng_files_of_ranks_gone_and_ranks_without_one():
    names = ["scheduler.bin", "random_states_0.pkl", "random_states_1.pkl", "random_states_2.pkl"]
    assert world_size_note(names, 3) is None
    assert world_size_note(names, 2) == (
        "random_states_2.pkl copied unchanged, for a rank a job of 2 does not have"
    )
    assert world_size_note(names, 1) == (
        "random_states_1.pkl, random_states_2.pkl copied unchanged, for ranks a job of 1 "
        "does not have"
    )
    assert world_size_note(names[:2], 3) == (
        "no random_states file for ranks 1, 2 of 3: accelerate's load_state leaves that RNG "
        "as it is"
    )
    assert world_size_note(names[:3], 3) == (
        "no random_states file for rank 2 of 3: accelerate's load_state leaves that RNG as it is"
    )
