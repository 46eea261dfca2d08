"""Exports that load: ``--only model`` to one file is rooted as ``load_state_dict`` takes it (issue 23, item 1).

Sources are what torch writes (``dcp.save``, ``torch.save``, ``save_file``) of the
example's model (tied weights, a buffer, two param groups) and its AdamW state, with a
step counter beside them as training loops keep one; every export is loaded back into
a fresh model with ``strict=True``.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.api import CheckpointException
from user_shell import REPO

from shardckpt.cli.app import run

sys.path.insert(0, str(REPO / "examples"))
from make_checkpoint import build_model, build_optimizer  # noqa: E402

NOTE = (
    "shardckpt: note: --only model to one file: DST's root is the 'model' subtree, as "
    "model.load_state_dict takes it"
)
KEEP = "; --filter 'model.*' keeps the 'model' key"


def trained_state() -> dict:
    """Return the example model and AdamW after one step, with a step counter, as loops save them."""
    model = build_model(seed=1)
    optimizer = build_optimizer(model)
    tokens = torch.randint(97, (2, 5), generator=torch.Generator().manual_seed(0))
    model(tokens).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": 1}


TRAINED = trained_state()


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Return a directory with the state as DCP (``dcp.save``) and as one ``torch.save`` file."""
    root = tmp_path_factory.mktemp("exports")
    state = TRAINED
    dcp.save(state, checkpoint_id=root / "ckpt-dcp", no_dist=True)
    torch.save(state, root / "ckpt.pt")
    torch.save({"model": state["model"]}, root / "model-only.pt")
    torch.save({"model": state["model"], "optim": state["optim"]}, root / "model-optim.pt")
    return root


def outcome(capsys, *argv) -> tuple[int, list[str]]:
    code = run([str(a) for a in argv])
    return code, capsys.readouterr().err.strip().splitlines()


def assert_loads_strictly(state: dict) -> None:
    """Load ``state`` into a fresh example model with strict=True; its values must be the trained ones."""
    fresh = build_model(seed=2)
    fresh.load_state_dict(state, strict=True)
    for name, value in build_model(seed=1).state_dict().items():
        assert fresh.state_dict()[name].shape == value.shape, name
    trained = TRAINED["model"]
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, trained[name]), name


@pytest.mark.parametrize("src", ["ckpt-dcp", "ckpt.pt"])
def test_only_model_to_safetensors_loads_into_the_model_with_strict(capsys, sources, tmp_path, src):
    out = tmp_path / "model.safetensors"
    code, err = outcome(capsys, "convert", sources / src, out, "--to", "full", "--only", "model")
    assert (code, err) == (0, [f"{NOTE} (left out beside it: 'step'){KEEP}"])
    assert_loads_strictly(load_file(out))


def test_only_model_to_a_torch_file_loads_with_torch_load(capsys, sources, tmp_path):
    out = tmp_path / "model.pt"
    assert (
        outcome(
            capsys, "convert", sources / "model-only.pt", out, "--to", "full", "--only", "model"
        )[0]
        == 0
    )
    assert_loads_strictly(torch.load(out, weights_only=True))


def test_a_checkpoint_with_only_model_needs_no_note_of_what_was_left_out(capsys, sources, tmp_path):
    out = tmp_path / "m.safetensors"
    code, err = outcome(
        capsys, "convert", sources / "model-only.pt", out, "--to", "full", "--only", "model"
    )
    assert (code, err) == (0, [f"{NOTE}{KEEP}"])


def test_only_model_with_unnest_model_works_beside_a_counter(capsys, sources, tmp_path):
    out = tmp_path / "m.safetensors"
    argv = ["convert", sources / "ckpt-dcp", out, *"--to full --only model --unnest model".split()]
    code, err = outcome(capsys, *argv)
    assert (code, err) == (
        0,
        ["shardckpt: note: --unnest model leaves out what --only model kept beside it: 'step'"],
    )
    assert_loads_strictly(load_file(out))


def test_unnest_without_only_model_still_refuses_to_drop_the_optimizer(capsys, sources, tmp_path):
    argv = ["convert", sources / "ckpt.pt", tmp_path / "m.pt", "--to", "full", "--unnest", "model"]
    code, err = outcome(capsys, *argv)
    assert code == 2 and err == [
        f"shardckpt: error: '{sources / 'ckpt.pt'}': --unnest model would leave out the other "
        "top-level keys beside it: 'optim', 'step': select 'model' alone first, e.g. --filter "
        "'model.*' (or --only model)"
    ]


def test_filter_keeps_the_model_key_in_one_file(capsys, sources, tmp_path):
    out = tmp_path / "nested.safetensors"
    argv = ["convert", sources / "ckpt.pt", out, "--to", "full", "--filter", "model.*"]
    assert outcome(capsys, *argv) == (0, [])
    assert all(name.startswith("model.") for name in load_file(out))


def test_only_model_to_dcp_keeps_the_model_key_that_dcp_load_expects(capsys, sources, tmp_path):
    out = tmp_path / "model-dcp"
    argv = [
        "convert",
        sources / "ckpt.pt",
        out,
        *"--to sharded --world-size 2 --only model".split(),
    ]
    assert outcome(capsys, *argv) == (0, [])
    fresh = build_model(seed=2)
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=out, no_dist=True)
    assert_loads_strictly(state["model"])


def test_a_flat_safetensors_to_dcp_says_dcp_load_needs_nest_model(capsys, tmp_path):
    # safetensors refuses tied tensors that share storage: a copy each, as save_model makes.
    flat = {k: v.clone() for k, v in TRAINED["model"].items()}
    save_file(flat, tmp_path / "flat.safetensors")
    code, err = outcome(
        capsys,
        "convert",
        tmp_path / "flat.safetensors",
        tmp_path / "flat-dcp",
        "--to",
        "sharded",
        "--world-size",
        "2",
    )
    assert (code, err) == (
        0,
        [
            "shardckpt: note: DST holds the FQNs at its root, as SRC does; dcp.load({'model': "
            "model.state_dict()}) and trainers' loaders look for them under 'model': pass "
            "--nest model for that"
        ],
    )
    with pytest.raises(CheckpointException, match="Missing key in checkpoint state_dict: model\\."):
        dcp.load(
            {"model": build_model().state_dict()}, checkpoint_id=tmp_path / "flat-dcp", no_dist=True
        )
    argv = ["convert", tmp_path / "flat.safetensors", tmp_path / "nested-dcp", "--to", "sharded"]
    assert outcome(capsys, *argv, "--world-size", "2", "--nest", "model") == (0, [])
    state = {"model": build_model(seed=2).state_dict()}
    dcp.load(state, checkpoint_id=tmp_path / "nested-dcp", no_dist=True)
    assert_loads_strictly(state["model"])


# ---------------------------------------------------------------- diff against such an export


@pytest.fixture(scope="module")
def export(sources, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "model.safetensors"
    argv = ["convert", sources / "ckpt-dcp", out, "--to", "full", "--only", "model", "-q"]
    assert run([str(a) for a in argv]) == 0
    return out


def test_diff_only_model_compares_the_checkpoints_model_with_the_exports_root(
    capsys, sources, export
):
    code = run(["diff", str(sources / "ckpt-dcp"), str(export), "--only", "model"])
    captured = capsys.readouterr()
    assert code == 0 and captured.out.startswith("equal: 25 leaves compared")
    assert captured.err.strip().splitlines() == [
        "shardckpt: note: --only model: comparing A's 'model' subtree with B's root, as convert "
        "--only model writes one file (left out beside it: 'step')"
    ]


def test_diff_against_the_export_suggests_only_model(capsys, sources, export):
    code = run(["diff", str(sources / "ckpt.pt"), str(export)])
    captured = capsys.readouterr()
    assert code == 1 and "embed.weight: only in B" in captured.out
    assert captured.err.strip().splitlines() == [
        "shardckpt: note: B holds A's model state at its root (a model-only export): pass "
        "--only model to compare them"
    ]


def test_diff_that_differs_only_in_optimizer_state_suggests_only_model(capsys, sources):
    code = run(["diff", str(sources / "model-only.pt"), str(sources / "model-optim.pt")])
    captured = capsys.readouterr()
    assert code == 1 and "optim.param_groups.0.lr: only in B" in captured.out
    assert captured.err.strip().splitlines() == [
        "shardckpt: note: only one side holds this optimizer state: pass --only model to "
        "compare the rest"
    ]
    assert (
        run(
            [
                "diff",
                str(sources / "model-only.pt"),
                str(sources / "model-optim.pt"),
                "--only",
                "model",
            ]
        )
        == 0
    )


def test_diff_with_more_than_optimizer_state_missing_gives_no_hint(capsys, sources):
    # A step counter differs too: --only model would not make them equal, so no hint.
    assert run(["diff", str(sources / "model-only.pt"), str(sources / "ckpt.pt")]) == 1
    captured = capsys.readouterr()
    assert "step: only in B" in captured.out and captured.err == ""


def test_diff_quiet_prints_no_note(capsys, sources, export):
    assert run(["diff", str(sources / "ckpt.pt"), str(export), "-q"]) == 1
    assert capsys.readouterr() == ("", "")
