"""Per-rank files that are not one save of one job are refused in one line naming both files."""

from __future__ import annotations

import os
from collections import OrderedDict

import pytest
import torch

from shardckpt import api
from shardckpt.cli.app import run
from shardckpt.formats.fsdp2.reader import quiet_mesh_unpickling


@pytest.fixture
def ranks(tmp_path):
    """``fsdp2-ranks`` files at 2 of an optimizer's state (no process group needed to write them)."""
    state = {"w": {"step": torch.tensor(3.0), "exp_avg": torch.arange(21.0).reshape(7, 3)}}
    groups = [{"lr": 0.1, "betas": (0.9, 0.95), "params": ["w"]}]
    torch.save({"optim": {"state": state, "param_groups": groups}}, tmp_path / "optim.pt")
    api.convert(
        api.ConvertRequest(
            src=tmp_path / "optim.pt", dst=tmp_path / "ranks", to="local", world_size=2
        )
    )
    return tmp_path / "ranks"


def _edit(directory, edit) -> None:
    """Rewrite ``rank_1.pt`` as ``edit`` leaves its state (written beside, then renamed)."""
    with quiet_mesh_unpickling():  # the mesh's process groups are not in this process
        state = torch.load(directory / "rank_1.pt", weights_only=True)
    edit(state)
    torch.save(state, directory / "edited.tmp")
    os.replace(directory / "edited.tmp", directory / "rank_1.pt")


def _error(capsys, directory) -> tuple[int, str]:
    code = run(["inspect", str(directory)])
    return code, capsys.readouterr().err.strip()


def _set_lr(state):
    state["optim"]["param_groups"][0]["lr"] = 0.2


def _tuple_to_list(state):
    state["optim"]["param_groups"][0]["betas"] = [0.9, 0.95]


def _drop_step(state):
    del state["optim"]["state"]["w"]["step"]


def _add_epoch(state):
    state["epoch"] = 7


def _ordered_state(state):
    state["optim"]["state"] = OrderedDict(state["optim"]["state"])


def _step_as_int(state):
    state["optim"]["state"]["w"]["step"] = torch.tensor(3)


@pytest.mark.parametrize(
    "edit, what",
    [
        (_set_lr, "'optim.param_groups.0.lr' is 0.2 here but 0.1 in 'rank_0.pt'"),
        (
            _tuple_to_list,
            "'optim.param_groups.0.betas' is [0.9, 0.95] here but (0.9, 0.95) in 'rank_0.pt'",
        ),
        (_drop_step, "has no 'optim.state.w.step', which 'rank_0.pt' has"),
        (_add_epoch, "has 'epoch', which 'rank_0.pt' has not"),
        (_ordered_state, "'optim.state' is an OrderedDict here but a dict in 'rank_0.pt'"),
        (
            _step_as_int,
            "'optim.state.w.step' is an int64 tensor [] here but a float32 tensor [] in "
            "'rank_0.pt'",
        ),
    ],
)
def test_a_rank_file_unlike_rank_0s_is_refused_naming_both(ranks, capsys, edit, what):
    _edit(ranks, edit)
    assert _error(capsys, ranks) == (
        3,
        f"shardckpt: error: '{ranks / 'rank_1.pt'}': {what}: keep one save's rank files in the "
        "directory",
    )


def test_one_saves_files_pass(ranks, tmp_path):
    assert api.diff(api.DiffRequest(a=ranks, b=tmp_path / "optim.pt")).equal
