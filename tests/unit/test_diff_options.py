"""diff -q, --only, --filter and --cast (issue 10, item 10), on real files through the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from optim_models import trained

from shardckpt.cli.app import run


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A trained checkpoint (fp32, with AdamW state), its model-only bf16 export, and an fp32 one."""
    root = tmp_path_factory.mktemp("diffopts")
    model, opt = trained("adamw")
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    torch.save(sd, root / "full.pt")
    for name, dtype in (("model-bf16.safetensors", "bf16"), ("model.safetensors", "keep")):
        argv = ["convert", root / "full.pt", root / name, "--to", "full", "--only", "model"]
        assert run([str(a) for a in [*argv, "--dtype", dtype, "-q"]]) == 0
    return root


def outcome(capsys, argv) -> tuple[int, str, str]:
    code = run([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(("b", "code"), [("full.pt", 0), ("model.safetensors", 1)])
def test_quiet_prints_nothing_and_the_exit_code_tells(capsys, ckpts, b, code):
    assert outcome(capsys, ["diff", ckpts / "full.pt", ckpts / b, "-q"]) == (code, "", "")


def test_quiet_with_json_is_a_usage_error(capsys, ckpts):
    code, out, err = outcome(capsys, ["diff", ckpts / "full.pt", ckpts / "full.pt", "-q", "--json"])
    assert (code, out, err.strip()) == (
        2,
        "",
        "shardckpt: error: --json has nothing to print under --quiet, which prints nothing: "
        "drop one of them",
    )


def test_only_model_compares_a_model_only_export_with_its_checkpoint(capsys, ckpts):
    code, out, _ = outcome(capsys, ["diff", ckpts / "full.pt", ckpts / "model.safetensors"])
    assert code == 1 and "only in A" in out and "optim." in out
    code, out, _ = outcome(
        capsys, ["diff", ckpts / "full.pt", ckpts / "model.safetensors", "--only", "model"]
    )
    assert code == 0 and out.startswith("equal: ")


def test_filter_keeps_the_leaves_it_matches_on_both_sides(capsys, ckpts):
    # The export holds the model at its root (fc.weight), the checkpoint under model.
    argv = ["diff", ckpts / "full.pt", ckpts / "model.safetensors", "--filter", "*fc.*"]
    code, out, err = outcome(capsys, [*argv, "--only", "model"])
    assert (code, out) == (0, "equal: 2 leaves compared\n")
    argv = [
        "diff",
        ckpts / "full.pt",
        ckpts / "full.pt",
        "--only",
        "optim",
        "--filter",
        "*.lr",
        "--json",
    ]
    code, out, _ = outcome(capsys, argv)
    doc = json.loads(out)
    assert code == 0 and doc["compared"] == 2  # lr of each of the two param groups


def test_without_cast_an_fp32_checkpoint_and_its_bf16_export_differ_in_dtype(capsys, ckpts):
    argv = ["diff", ckpts / "full.pt", ckpts / "model-bf16.safetensors", "--only", "model"]
    code, out, _ = outcome(capsys, [*argv, "--atol", "1e-2"])
    assert code == 1 and "dtype float32 vs bfloat16" in out


def test_cast_compares_in_the_wider_dtype_and_says_so_once(capsys, ckpts):
    argv = [
        "diff",
        ckpts / "full.pt",
        ckpts / "model-bf16.safetensors",
        "--only",
        "model",
        "--cast",
    ]
    code, out, _ = outcome(capsys, [*argv, "--atol", "1e-2"])
    floats = [k for k, t in torch.load(ckpts / "full.pt")["model"].items() if t.is_floating_point()]
    lines = out.splitlines()
    assert code == 0, out
    assert (
        lines[0] == f"compared {len(floats)} tensors of float32 in A and bfloat16 in B as float32"
    )
    assert lines[1].startswith("equal: ") and len(lines) == 2
    # Exact after the cast: bf16 rounding is a difference, with its size.
    code, out, _ = outcome(capsys, argv)
    assert code == 1 and "values differ, max abs diff" in out and "dtype" not in out
    code, out, _ = outcome(capsys, [*argv, "--atol", "1e-2", "--json"])
    assert json.loads(out)["casts"] == [
        {"a": "float32", "b": "bfloat16", "as": "float32", "tensors": len(floats)}
    ]


def test_cast_leaves_non_floating_dtype_changes_as_differences(capsys, tmp_path):
    torch.save({"n": torch.arange(4, dtype=torch.int64)}, tmp_path / "a.pt")
    torch.save({"n": torch.arange(4, dtype=torch.int32)}, tmp_path / "b.pt")
    code, out, _ = outcome(capsys, ["diff", tmp_path / "a.pt", tmp_path / "b.pt", "--cast"])
    assert code == 1 and "n: dtype int64 vs int32" in out and "compared" not in out.splitlines()[0]
