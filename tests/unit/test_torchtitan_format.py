"""The ``torchtitan`` format without ranks: detection, and the trees ``--format torchtitan`` refuses
or reshapes (one-line errors, exact text)."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from optim_models import trained
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from shardckpt import api
from shardckpt.cli.app import run
from shardckpt.formats import detect

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def titan_tree(flat: bool = True) -> dict:
    """Return a tiny tree shaped as torchtitan saves it: model FQNs at the top level, parts beside."""
    model, opt = trained("adamw")
    msd, osd = get_state_dict(model, opt, options=FLAT if flat else None)
    return {"optimizer": osd, "lr_scheduler": {"last_epoch": 2}, **msd}


def error_of(capsys, argv) -> tuple[int, str]:
    code = run([str(a) for a in argv])
    return code, capsys.readouterr().err.strip().splitlines()[-1]


def test_a_dcp_with_torchtitans_parts_is_torchtitan_and_a_plain_one_stays_dcp(tmp_path):
    dcp.save(titan_tree(), checkpoint_id=tmp_path / "titan", no_dist=True)
    model, opt = trained("adamw")
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp_path / "plain", no_dist=True)
    dcp.save(msd, checkpoint_id=tmp_path / "model-only", no_dist=True)
    assert detect(tmp_path / "titan") == "torchtitan"
    assert detect(tmp_path / "plain") == "dcp"
    assert detect(tmp_path / "model-only") == "dcp"


def test_a_nested_fqn_optimizer_is_flattened_for_torchtitan(tmp_path):
    torch.save(titan_tree(flat=False), tmp_path / "nested.pt")
    api.convert(
        api.ConvertRequest(
            src=tmp_path / "nested.pt",
            dst=tmp_path / "step-2",
            to="sharded",
            format="torchtitan",
            world_size=2,
        )
    )
    dcp.save(titan_tree(), checkpoint_id=tmp_path / "flat", no_dist=True)
    assert api.inspect(api.InspectRequest(src=tmp_path / "step-2")).optimizers[0].key_type == "flat"
    assert not api.diff(api.DiffRequest(a=tmp_path / "flat", b=tmp_path / "step-2")).differences


def test_a_model_under_a_model_key_is_refused_for_torchtitan(capsys, tmp_path):
    model, opt = trained("adamw")
    msd, osd = get_state_dict(model, opt, options=FLAT)
    torch.save({"model": msd, "optimizer": osd}, tmp_path / "m.pt")
    argv = ["convert", tmp_path / "m.pt", tmp_path / "o", "--to", "sharded", "--world-size", "2"]
    assert error_of(capsys, [*argv, "--format", "torchtitan"]) == (
        2,
        f"shardckpt: error: '{tmp_path / 'm.pt'}': holds its model state under 'model', and "
        "torchtitan loads model FQNs from the top level (its loader would silently skip them): "
        "write --format dcp, or convert a checkpoint torchtitan saved",
    )


def test_an_optimizer_elsewhere_than_optimizer_is_refused_for_torchtitan(capsys, tmp_path):
    tree = titan_tree()
    tree["optim"] = tree.pop("optimizer")
    torch.save(tree, tmp_path / "o.pt")
    argv = ["convert", tmp_path / "o.pt", tmp_path / "o", "--to", "sharded", "--world-size", "2"]
    assert error_of(capsys, [*argv, "--format", "torchtitan"]) == (
        2,
        f"shardckpt: error: '{tmp_path / 'o.pt'}': has an optimizer at 'optim', and torchtitan "
        "loads its optimizer from 'optimizer' only: write --format dcp, or convert a checkpoint "
        "torchtitan saved",
    )


def test_an_id_keyed_optimizer_for_torchtitan_asks_for_optim_keys_flat(capsys, tmp_path):
    model, opt = trained("adamw")
    torch.save({"optimizer": opt.state_dict(), **model.state_dict()}, tmp_path / "i.pt")
    argv = ["convert", tmp_path / "i.pt", tmp_path / "o", "--to", "sharded", "--world-size", "2"]
    assert error_of(capsys, [*argv, "--format", "torchtitan"]) == (
        2,
        f"shardckpt: error: '{tmp_path / 'i.pt'}': has an optimizer keyed by param ID, and "
        "torchtitan loads the flattened form: add --optim-keys flat",
    )
    assert run([str(a) for a in [*argv, "--format", "torchtitan", "--optim-keys", "flat"]]) == 0
    assert api.inspect(api.InspectRequest(src=tmp_path / "o")).optimizers[0].key_type == "flat"


def test_the_cli_names_the_format_and_lists_the_parts(capsys, tmp_path):
    tree = titan_tree()
    tree["dataloader"] = {"dp_rank_0": b"state", "world_size": 1}
    dcp.save(tree, checkpoint_id=tmp_path / "step-2", no_dist=True)
    assert run(["inspect", str(tmp_path / "step-2"), "--from", "torchtitan"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"{tmp_path / 'step-2'}: format torchtitan, world size 1"
    assert (
        "  dataloader: values, per-rank state of 1 data-parallel rank (dp_rank_0); torchtitan "
        "loads it only at that data-parallel degree\n" in out
    )
    argv = ["convert", tmp_path / "step-2", tmp_path / "o", "--from", "torchtitan", "--to"]
    assert (
        run([str(a) for a in [*argv, "sharded", "--format", "torchtitan", "--world-size", "2"]])
        == 0
    )
    assert capsys.readouterr().err.strip().splitlines()[0] == (
        "shardckpt: note: 'dataloader' holds the data loader state of 1 data-parallel rank, "
        "carried unchanged: torchtitan does not reshard data loaders, so where the "
        "data-parallel degree at 2 ranks differs, resume with "
        "--checkpoint.exclude_from_loading dataloader"
    )
