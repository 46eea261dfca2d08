"""`--rename`/`--drop` patterns see the paths `inspect` prints, and one that matches nothing is exit 2.

A pattern is tried on each FQN and, where it finds nothing there, on the path ``inspect``
prints for the tensor (the FQN under the tree's top key), so a path copied from
``inspect`` works as one written against the FQN did; a parameter's optimizer state is
named by its model tensor's path, so both go (or are renamed) together (issue 35 item 4).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed.checkpoint as dcp
from optim_models import trained

from shardckpt.cli.app import run


def cli(capsys, *argv) -> tuple[int, str, list[str]]:
    code = run([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip().splitlines()


def _tree() -> dict:
    """A {model, optim} tree whose FQNs, as HF writes them, start with 'model.' themselves."""
    model = {f"model.layers.{i}.w": torch.full((2, 3), float(i)) for i in range(3)}
    model["lm_head.weight"] = torch.full((4, 3), 9.0)
    optim = {
        "state": {k: {"exp_avg": v + 10, "step": torch.tensor(3.0)} for k, v in model.items()},
        "param_groups": [{"lr": 0.1, "params": list(model)}],
    }
    return {"model": model, "optim": optim, "epoch": 2}


@pytest.fixture(params=["torch", "dcp"])
def src(request, tmp_path):
    """The tree as one torch.save file, and as a DCP directory."""
    if request.param == "torch":
        torch.save(_tree(), tmp_path / "src.pt")
        return tmp_path / "src.pt"
    dcp.save(_tree(), checkpoint_id=tmp_path / "src-dcp", no_dist=True)
    return tmp_path / "src-dcp"


def inspected_paths(capsys, src) -> list[str]:
    """Return the PATH column of `shardckpt inspect SRC`, as a user would copy it."""
    code, out, _ = cli(capsys, "inspect", src)
    assert code == 0
    table = out.split("\n\n")[1].splitlines()
    return [line.split()[0] for line in table[1:] if line and not line.startswith(" ")]


def assert_nothing_left(dst) -> None:
    assert not dst.exists()
    assert sorted(p.name for p in dst.parent.iterdir() if "shardckpt" in p.name) == []


HINT = "patterns are matched (re.search) against names such as '{}', or as `shardckpt inspect` prints it, 'model.{}'"


@pytest.mark.parametrize(
    ("edits", "named"),
    [
        (["--rename", "nomatch=x"], "--rename 'nomatch=x'"),
        (["--drop", "nomatch"], "--drop 'nomatch'"),
        # optim.state.* is not a parameter's path: its model tensor's is.
        (["--drop", r"^optim\.state\.model\.layers\.0\."], r"--drop '^optim\.state\.model\.layers\.0\.'"),
        # The second matches only what the first already dropped.
        (["--drop", r"layers\.1\.", "--rename", r"layers\.1\.=layers.7."], r"--rename 'layers\.1\.=layers.7.'"),
        (["--rename", r"^model\.layers\.=blocks.", "--drop", r"^model\.layers\."], r"--drop '^model\.layers\.'"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("to", [["full"], ["sharded", "--world-size", "2"]])
def test_a_pattern_that_matches_nothing_is_a_usage_error_naming_it(
    capsys, src, tmp_path, edits, named, to
):
    dst = tmp_path / "out" / ("o.pt" if to == ["full"] else "o")
    dst.parent.mkdir()
    code, out, err = cli(capsys, "convert", src, dst, "--to", *to, *edits)
    assert (code, out) == (2, "")
    # The hint shows a name as the edits before this one left it.
    first = "blocks.0.w" if "blocks." in " ".join(edits) else "model.layers.0.w"
    assert err == [
        f"shardckpt: error: '{src}': {named} matches no tensor's name: {HINT.format(first, first)}"
    ]
    assert_nothing_left(dst)


def test_a_drop_copied_from_inspect_drops_the_tensor_and_its_optimizer_state(capsys, src, tmp_path):
    paths = inspected_paths(capsys, src)
    assert "model.model.layers.1.w" in paths  # the FQN under the tree's top key
    out = tmp_path / "o.pt"
    code, _, err = cli(
        capsys, "convert", src, out, "--to", "full", "--drop", "model.model.layers.1.w", "-q"
    )
    assert (code, err) == (0, [])
    got = torch.load(out)
    kept = ["model.layers.0.w", "model.layers.2.w", "lm_head.weight"]
    assert list(got["model"]) == kept
    assert list(got["optim"]["state"]) == kept
    assert got["optim"]["param_groups"][0]["params"] == kept
    assert got["epoch"] == 2


@pytest.mark.parametrize(
    "pattern",
    [
        r"^model\.model\.layers\.1\.",  # the path inspect prints, anchored
        r"^model\.layers\.1\.",  # the FQN, as before
        re.escape("model.model.layers.1.w"),
    ],
)
def test_a_drop_by_path_or_by_fqn_drops_the_same(capsys, src, tmp_path, pattern):
    out = tmp_path / "o.pt"
    code, _, err = cli(capsys, "convert", src, out, "--to", "full", "--drop", pattern, "-q")
    assert (code, err) == (0, [])
    got = torch.load(out)
    assert "model.layers.1.w" not in got["model"]
    assert "model.layers.1.w" not in got["optim"]["state"]
    assert len(got["model"]) == len(got["optim"]["state"]) == 3


@pytest.mark.parametrize(
    "rename",
    [
        r"^model\.lm_head\.=model.output.",  # by the path inspect prints
        r"^lm_head\.=output.",  # by the FQN
    ],
)
def test_a_rename_by_path_renames_model_state_and_params_alike(capsys, src, tmp_path, rename):
    out = tmp_path / "o.pt"
    code, _, err = cli(capsys, "convert", src, out, "--to", "full", "--rename", rename, "-q")
    assert (code, err) == (0, [])
    got = torch.load(out)
    names = ["model.layers.0.w", "model.layers.1.w", "model.layers.2.w", "output.weight"]
    assert list(got["model"]) == names
    assert list(got["optim"]["state"]) == names
    assert got["optim"]["param_groups"][0]["params"] == names
    assert torch.equal(got["optim"]["state"]["output.weight"]["exp_avg"], torch.full((4, 3), 19.0))


def test_a_rename_by_path_that_would_leave_its_top_key_is_refused(capsys, src, tmp_path):
    dst = tmp_path / "out" / "o.pt"
    dst.parent.mkdir()
    argv = ["convert", src, dst, "--to", "full", "--rename", r"^model\.lm_head\.=head."]
    code, out, err = cli(capsys, *argv)
    assert (code, out) == (2, "")
    assert err == [
        f"shardckpt: error: '{src}': --rename '^model\\.lm_head\\.=head.' would move "
        "'model.lm_head.weight' to 'head.weight', out of 'model': rename what follows 'model.' "
        "(to move a subtree, use --unnest/--nest)"
    ]
    assert_nothing_left(dst)


def test_an_id_keyed_optimizer_is_renamed_with_its_model_by_path(capsys, tmp_path):
    """Plain torch.optim keys state by ID: the rename reaches param_names, and IDs stay IDs."""
    model, opt = trained("adamw")
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "plain.pt")
    first = next(iter(model.state_dict()))
    out = tmp_path / "o.pt"
    argv = ["convert", tmp_path / "plain.pt", out, "--to", "full", "-q"]
    code, _, err = cli(capsys, *argv, "--drop", re.escape(f"model.{first}"), "--optim-keys", "fqn")
    assert (code, err) == (0, [])
    got = torch.load(out)
    assert first not in got["model"] and first not in got["optim"]["state"]
    assert all(first not in g["params"] for g in got["optim"]["param_groups"])
    assert sorted(got["optim"]["state"]) == sorted(
        k
        for k in got["model"]
        if k in {p for g in got["optim"]["param_groups"] for p in g["params"]}
    )


@pytest.mark.parametrize(
    ("tree", "edits", "hint"),
    [
        ({"epoch": 1}, ["--drop", "w"], "the checkpoint holds no tensor to rename or drop"),
        (
            {"w": torch.zeros(2)},
            ["--drop", "w", "--rename", "w=v"],
            "the edits before it left no tensor to match",
        ),
    ],
)
def test_a_pattern_with_nothing_left_to_match_says_so(capsys, tmp_path, tree, edits, hint):
    torch.save(tree, tmp_path / "src.pt")
    dst = tmp_path / "out" / "o.pt"
    dst.parent.mkdir()
    code, out, err = cli(capsys, "convert", tmp_path / "src.pt", dst, "--to", "full", *edits)
    named = f"{edits[-2]} '{edits[-1]}'"
    assert (code, out) == (2, "")
    assert err == [
        f"shardckpt: error: '{tmp_path / 'src.pt'}': {named} matches no tensor's name: {hint}"
    ]
    assert_nothing_left(dst)


def test_a_pattern_reads_every_name_one_way(capsys, src, tmp_path):
    """'^model\\.' finds HF FQNs, so it strips their prefix and leaves 'lm_head.weight' (whose
    path starts 'model.' too) as it is, as it always did."""
    out = tmp_path / "o.pt"
    code, _, err = cli(capsys, "convert", src, out, "--to", "full", "--rename", r"^model\.=", "-q")
    assert (code, err) == (0, [])
    got = torch.load(out)
    names = ["layers.0.w", "layers.1.w", "layers.2.w", "lm_head.weight"]
    assert list(got["model"]) == list(got["optim"]["state"]) == names
