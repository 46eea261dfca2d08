"""``torch-checkpointing`` (issue 11): a checkpoint torch_checkpointing 0.1.1 saved on two gloo
ranks (FSDP2 model as per-rank safetensors, AdamW as per-rank torch.save, a step counter
saved without a resharder) is inspected, converted to full (equal to the in-memory
state), converted to the same layout at 3 and loaded there by the library itself:
bit-identical to the library's own resharding load of the original at 3, one training
step included."""

from __future__ import annotations

import pickle
import shutil

import pytest
import ranks
import torch
import torch_checkpointing_jobs as jobs
from harness import run_ranks
from reference import assert_trees_equal

from shardckpt import api
from shardckpt.cli.app import run

pytestmark = pytest.mark.trainers
pytest.importorskip("torch_checkpointing")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Return (the checkpoint directory, the full state the two ranks held when saving)."""
    root = tmp_path_factory.mktemp("tcp") / "step-2"
    (state, _) = run_ranks(jobs.save, 2, str(root))
    return root, state


def test_inspect_shows_each_items_shards_and_the_optimizer(saved):
    root, _ = saved
    found = api.inspect(api.InspectRequest(src=root))
    assert (found.index.format, found.index.world_size) == ("torch-checkpointing", 2)
    layouts = {".".join(map(str, p)): m.layout for p, m in found.index.tensors()}
    assert layouts["model.fc.weight"] == "Shard(0) over 2"
    assert layouts["model.scale"] == layouts["optim.state.fc.weight.step"] == "full"
    assert [(o.path, o.key_type) for o in found.optimizers] == [(("optim",), "fqn")]
    assert found.index.tree["step"] == 2


def test_full_output_is_the_state_the_ranks_held(saved, tmp_path):
    root, state = saved
    api.convert(api.ConvertRequest(src=root, dst=tmp_path / "full.pt", to="full", verify=True))
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert_trees_equal(full, {**state, "step": 2})


def test_at_3_the_library_resumes_bit_identically_to_its_own_reshard(saved, tmp_path):
    root, state = saved
    dst = tmp_path / "at3"
    argv = ["convert", str(root), str(dst), "--to", "sharded", "--format", "torch-checkpointing"]
    assert run([*argv, "--world-size", "3", "--verify", "-q"]) == 0
    assert sorted(p.name for p in dst.iterdir()) == sorted(
        ["metadata.pkl"]
        + [f"{item}_{r}.{ext}" for item, ext in (("model", "safetensors"), ("optim", "pt"),
                                                 ("step", "pt")) for r in range(3)]
    )  # fmt: skip
    # The library cannot load the original's step at 3 (no step_2.pt): control without it.
    control = run_ranks(jobs.load, 3, str(root), False)[0]
    ours = run_ranks(jobs.load, 3, str(dst))[0]
    assert ours.pop("step") == 2 and control.pop("step") is None
    assert_trees_equal(ours, control)
    assert_trees_equal({"model": ours["model"], "optim": ours["optim"]}, state)


@pytest.fixture
def copy(saved, tmp_path):
    shutil.copytree(saved[0], tmp_path / "ckpt")
    return tmp_path / "ckpt"


def error_of(capsys, argv) -> tuple[int, str]:
    code = run([str(a) for a in argv])
    return code, capsys.readouterr().err.strip().splitlines()[-1]


def test_metadata_that_names_a_class_is_refused_not_run(copy, capsys):
    (copy / "metadata.pkl").write_bytes(pickle.dumps(print))
    assert error_of(capsys, ["inspect", copy]) == (
        3,
        f"shardckpt: error: '{copy / 'metadata.pkl'}': refused to unpickle (names "
        "builtins.print; torch_checkpointing writes plain values only): shardckpt runs no code "
        "from metadata.pkl, with --trust-pickle or without; use the metadata.pkl "
        "torch_checkpointing wrote",
    )


def test_metadata_that_lies_about_a_shard_is_named(copy, capsys):
    meta = pickle.loads((copy / "metadata.pkl").read_bytes())
    group = meta["metadata"]["model"]["nested_path_to_metadata"]['["fc.weight"]'][0]
    group["sharding_metadata"]["data"]["global_shape"] = [9, 3]
    (copy / "metadata.pkl").write_bytes(pickle.dumps(meta))
    assert error_of(capsys, ["inspect", copy]) == (
        3,
        f"shardckpt: error: '{copy / 'model_0.safetensors'}': 'fc.weight' should be rank 0's "
        "torch.float32 shard of shape [5, 3] by metadata.pkl, but is torch.float32 [4, 3]: "
        "the files and the metadata are not one save; re-copy the checkpoint",
    )


def test_a_file_that_is_no_part_of_the_checkpoint_is_named_not_skipped(copy, capsys):
    (copy / "notes.txt").write_text("hi")
    assert error_of(capsys, ["inspect", copy]) == (
        3,
        f"shardckpt: error: '{copy}': holds 'notes.txt', which is no part of this "
        "torch_checkpointing checkpoint that shardckpt can read (not listed in metadata.pkl, "
        "not <item>_<rank>.pt of a rank below 2): move it out of the checkpoint directory, "
        "or convert a copy without it",
    )


def test_an_item_that_differs_between_ranks_is_refused_when_selected(copy, capsys, tmp_path):
    torch.save(3, copy / "step_1.pt")
    assert api.inspect(api.InspectRequest(src=copy)).warnings == [
        "item 'step' differs between ranks (per-rank state): rank 0's is shown, and convert "
        "refuses it unless --filter leaves it out"
    ]
    argv = ["convert", copy, tmp_path / "full.pt", "--to", "full"]
    assert error_of(capsys, argv) == (
        3,
        f"shardckpt: error: '{copy}': item 'step' differs between ranks ('step_0.pt' vs the "
        "others): per-rank state cannot be carried to another world size: leave it out: "
        "select the other items with --filter 'ITEM.*' (repeatable)",
    )
    assert run([str(a) for a in [*argv, "--filter", "model.*", "-q"]]) == 0


def test_two_ranks_write_the_same_bytes_as_one(saved, tmp_path):
    root, _ = saved
    kwargs = {"format": "torch-checkpointing", "world_size": 3}
    api.convert(api.ConvertRequest(src=root, dst=tmp_path / "one", to="sharded", **kwargs))
    run_ranks(ranks.convert, 2, str(root), str(tmp_path / "two"), "sharded", kwargs)
    assert {p.name: p.read_bytes() for p in (tmp_path / "two").iterdir()} == {
        p.name: p.read_bytes() for p in (tmp_path / "one").iterdir()
    }
