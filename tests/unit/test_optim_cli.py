"""`convert --optim-keys/--model/--rename/--drop` and `inspect` on ID-keyed optimizers, end to end."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from optim_models import trained
from reference import assert_trees_equal
from torch.distributed.checkpoint.state_dict import get_state_dict

from shardckpt.cli.app import run


def error_of(capsys, argv):
    code = run([str(a) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


@pytest.fixture
def plain(tmp_path):
    """A torch.save of a plain model and its ID-keyed AdamW, and the FQN-keyed truth."""
    model, opt = trained("adamw")
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "plain.pt")
    return tmp_path / "plain.pt", get_state_dict(model, opt)[1]


@pytest.fixture
def ambiguous(tmp_path):
    """Two same-shaped parameters, one per group: their IDs could be either way round."""
    sd = {
        "model": {"a": torch.zeros(3), "b": torch.ones(3)},
        "optim": {
            "state": {0: {"m": torch.zeros(3)}, 1: {"m": torch.ones(3)}},
            "param_groups": [{"lr": 0.1, "params": [0]}, {"lr": 0.2, "params": [1]}],
        },
    }
    torch.save(sd, tmp_path / "amb.pt")
    return tmp_path / "amb.pt"


@pytest.mark.parametrize("model", [[], ["--model", "optim_models:tiny_with_groups"]])
def test_id_to_fqn_from_inference_or_model_equals_get_state_dict(plain, tmp_path, model):
    src, by_fqn = plain
    argv = ["convert", src, tmp_path / "out.pt", "--to", "full", "--optim-keys", "fqn", *model]
    assert run([str(a) for a in argv]) == 0
    assert_trees_equal(torch.load(tmp_path / "out.pt", weights_only=True)["optim"], by_fqn)


def test_fqn_keyed_dcp_to_ids_then_back_to_fqns_is_exact(plain, tmp_path):
    src, by_fqn = plain
    assert (
        run(
            [
                "convert",
                str(src),
                str(tmp_path / "d"),
                "--to",
                "sharded",
                "--world-size",
                "1",
                "--optim-keys",
                "fqn",
            ]
        )
        == 0
    )
    assert (
        run(
            [
                "convert",
                str(tmp_path / "d"),
                str(tmp_path / "ids.safetensors"),
                "--to",
                "full",
                "--optim-keys",
                "id",
            ]
        )
        == 0
    )
    assert (
        run(
            [
                "convert",
                str(tmp_path / "ids.safetensors"),
                str(tmp_path / "d2"),
                "--to",
                "sharded",
                "--world-size",
                "1",
                "--optim-keys",
                "fqn",
            ]
        )
        == 0
    )
    assert run(["convert", str(tmp_path / "d2"), str(tmp_path / "back.pt"), "--to", "full"]) == 0
    assert_trees_equal(torch.load(tmp_path / "back.pt", weights_only=True)["optim"], by_fqn)


def test_id_keys_read_from_dcp_come_out_as_ints(plain, tmp_path):
    src, _ = plain
    ref = torch.load(src, weights_only=True)
    dcp.save(ref, checkpoint_id=tmp_path / "ids-dcp", no_dist=True)
    assert (
        run(
            [
                "convert",
                str(tmp_path / "ids-dcp"),
                str(tmp_path / "o.pt"),
                "--to",
                "full",
                "--optim-keys",
                "id",
            ]
        )
        == 0
    )
    assert_trees_equal(torch.load(tmp_path / "o.pt", weights_only=True), ref)


def test_ambiguous_inference_asks_for_model(capsys, ambiguous, tmp_path):
    argv = ["convert", ambiguous, tmp_path / "o.pt", "--to", "full", "--optim-keys", "fqn"]
    assert error_of(capsys, argv) == (
        2,
        f"shardckpt: error: '{ambiguous}': cannot tell the FQN of each optimizer param ID: "
        "more than one assignment of the model's tensors fits the optimizer's IDs: "
        "pass --model pkg.module:factory returning (module, param_groups)",
    )
    assert not (tmp_path / "o.pt").exists()


def test_drop_on_an_ambiguous_id_keyed_optimizer_also_asks_for_model(capsys, ambiguous, tmp_path):
    code, line = error_of(
        capsys, ["convert", ambiguous, tmp_path / "o.pt", "--to", "full", "--drop", "^a$"]
    )
    assert code == 2 and line.endswith(
        "pass --model pkg.module:factory returning (module, param_groups)"
    )


def test_bad_rename_syntax(capsys, plain, tmp_path):
    argv = ["convert", plain[0], tmp_path / "o.pt", "--to", "full", "--rename", "blocks"]
    assert error_of(capsys, argv) == (
        2,
        "shardckpt: error: --rename 'blocks' is not REGEX=REPL: write it like --rename '^encoder\\.=backbone.'",
    )


def test_bad_rename_regex(capsys, plain, tmp_path):
    argv = ["convert", plain[0], tmp_path / "o.pt", "--to", "full", "--rename", "(x=y"]
    assert error_of(capsys, argv) == (
        2,
        "shardckpt: error: --rename '(x=y': bad regular expression or replacement "
        "(missing ), unterminated subpattern at position 0): use Python re syntax; escape dots as \\.",
    )


def test_model_that_cannot_be_imported(capsys, plain, tmp_path):
    argv = [
        "convert",
        plain[0],
        tmp_path / "o.pt",
        "--to",
        "full",
        "--model",
        "no_such_pkg.m:build",
    ]
    assert error_of(capsys, argv) == (
        2,
        "shardckpt: error: --model 'no_such_pkg.m:build': cannot import 'no_such_pkg.m' "
        "(ModuleNotFoundError: No module named 'no_such_pkg'): "
        "check the module name and that its package is on PYTHONPATH",
    )


def test_model_factory_that_raises(capsys, plain, tmp_path):
    argv = [
        "convert",
        plain[0],
        tmp_path / "o.pt",
        "--to",
        "full",
        "--model",
        "optim_models:broken",
    ]
    assert error_of(capsys, argv) == (
        2,
        "shardckpt: error: --model 'optim_models:broken' failed on the meta device "
        "(RuntimeError: boom): pass --model pkg.module:factory, a zero-argument callable "
        "returning a module or (module, param_groups)",
    )


def test_optim_keys_on_a_checkpoint_without_optimizer_is_a_usage_error(capsys, tmp_path):
    torch.save({"model": {"w": torch.zeros(2)}}, tmp_path / "m.pt")
    argv = ["convert", tmp_path / "m.pt", tmp_path / "o.pt", "--to", "full", "--optim-keys", "id"]
    assert error_of(capsys, argv) == (
        2,
        f"shardckpt: error: '{tmp_path / 'm.pt'}': --optim-keys id: the checkpoint holds no "
        "optimizer state: drop --optim-keys (it applies to dicts with 'state' and 'param_groups')",
    )


def test_inspect_reports_id_keys_and_warns_about_stray_and_stateless(capsys, tmp_path):
    model, opt = trained("sgd")
    osd = opt.state_dict()
    del osd["state"][1]
    osd["state"][99] = {"momentum_buffer": torch.zeros(1)}
    dcp.save(
        {"model": model.state_dict(), "optim": osd}, checkpoint_id=tmp_path / "d", no_dist=True
    )
    torch.save({"model": model.state_dict(), "optim": osd}, tmp_path / "f.pt")
    for src in (tmp_path / "d", tmp_path / "f.pt"):
        capsys.readouterr()
        assert run(["inspect", str(src), "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        (info,) = doc["optimizers"]
        assert (info["key_type"], info["num_params"], info["num_groups"]) == ("id", 6, 2)
        stray = "'99'" if src.is_dir() else "99"
        assert doc["warnings"] == [
            f"optim: state for 1 key in no param group, e.g. {stray}",
            "optim: 1 parameter without state yet, e.g. 1",
        ]


def test_an_optimizer_alone_needs_model_for_its_fqns(capsys, tmp_path):
    model, opt = trained("adagrad")
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    argv = [
        "convert",
        tmp_path / "opt.pt",
        tmp_path / "o.pt",
        "--to",
        "full",
        "--optim-keys",
        "fqn",
    ]
    assert error_of(capsys, argv) == (
        2,
        f"shardckpt: error: '{tmp_path / 'opt.pt'}': cannot tell the FQN of each optimizer param "
        "ID: the checkpoint holds no model state to take the parameter order from: "
        "pass --model pkg.module:factory returning (module, param_groups)",
    )
    assert run([str(a) for a in argv] + ["--model", "optim_models:tiny_with_groups"]) == 0
    assert_trees_equal(
        torch.load(tmp_path / "o.pt", weights_only=True), get_state_dict(model, opt)[1]
    )


@pytest.mark.parametrize("to", ["sharded", "full"])
def test_verify_accepts_id_keys_as_each_format_stores_them(plain, tmp_path, to):
    # DCP hands ID keys back as "0", "1", ...; --verify must compare with that, not fail.
    src, _ = plain
    dst = tmp_path / ("ids" if to == "sharded" else "ids.pt")
    argv = ["convert", src, dst, "--to", to, "--optim-keys", "id", "--verify", "--json"]
    argv += ["--world-size", "1"] if to == "sharded" else []
    assert run([str(a) for a in argv]) == 0


def test_diff_of_an_id_keyed_file_and_its_dcp_conversion_is_equal(plain, tmp_path):
    src, _ = plain
    assert (
        run(["convert", str(src), str(tmp_path / "d"), "--to", "sharded", "--world-size", "1"]) == 0
    )
    assert run(["diff", str(src), str(tmp_path / "d")]) == 0


def _blocks(tmp_path):
    """Return a full checkpoint of blocks 0..4 (block i holds the value i) with its optimizer."""
    model = {f"blocks.{i}.w": torch.full((2, 3), float(i)) for i in range(5)}
    optim = {
        "state": {k: {"exp_avg": v + 10, "step": torch.tensor(3.0)} for k, v in model.items()},
        "param_groups": [{"lr": 0.1, "params": list(model)}],
    }
    torch.save({"model": model, "optim": optim}, tmp_path / "blocks.pt")
    return tmp_path / "blocks.pt"


@pytest.mark.parametrize(
    "edits",
    [
        ["--drop", r"^blocks\.3\.", "--rename", r"^blocks\.4\.=blocks.3."],
        # The =VALUE forms; and a value that reads like an option ("--drop", a glob that
        # matches nothing here) belongs to the option before it.
        [
            r"--drop=^blocks\.3\.",
            "--filter",
            "*",
            "--filter",
            "--drop",
            r"--rename=^blocks\.4\.=blocks.3.",
        ],
    ],
)
def test_rename_and_drop_apply_in_the_order_given(tmp_path, edits):
    """The documented example removes block 3 and moves block 4 into its place."""
    out = tmp_path / "o.pt"
    argv = ["convert", _blocks(tmp_path), out, "--to", "full", *edits, "-q"]
    assert run([str(a) for a in argv]) == 0
    got = torch.load(out)
    assert list(got["model"]) == ["blocks.0.w", "blocks.1.w", "blocks.2.w", "blocks.3.w"]
    assert torch.equal(got["model"]["blocks.3.w"], torch.full((2, 3), 4.0))
    assert torch.equal(got["optim"]["state"]["blocks.3.w"]["exp_avg"], torch.full((2, 3), 14.0))
    assert got["optim"]["param_groups"][0]["params"] == list(got["model"])


def test_rename_before_drop_drops_what_the_rename_made(tmp_path):
    out = tmp_path / "o.pt"
    argv = [
        "convert",
        _blocks(tmp_path),
        out,
        "--to",
        "full",
        "--rename",
        r"^blocks\.4\.=blocks.3.",
        "--drop",
        r"^blocks\.3\.",
        "-q",
    ]
    assert run([str(a) for a in argv]) == 0
    assert list(torch.load(out)["model"]) == ["blocks.0.w", "blocks.1.w", "blocks.2.w"]
