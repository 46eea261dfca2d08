"""Which world size DST is for (issue 10, item 6): never a silent 1."""

from __future__ import annotations

import pytest
import torch

from shardckpt.api import ConvertRequest
from shardckpt.api.conversion import _target_world_size
from shardckpt.cli.app import run
from shardckpt.core.dist import Runtime


@pytest.fixture
def src(tmp_path):
    torch.save({"model": {"w": torch.arange(21.0).reshape(7, 3)}}, tmp_path / "src.pt")
    return tmp_path / "src.pt"


@pytest.mark.parametrize("to", ["sharded", "local"])
def test_standalone_sharded_and_local_outputs_need_world_size(capsys, src, tmp_path, to):
    code = run(["convert", str(src), str(tmp_path / "out"), "--to", to])
    assert (code, capsys.readouterr().err.strip()) == (
        2,
        f"shardckpt: error: --to {to} needs --world-size outside torchrun: "
        "pass --world-size M, the number of ranks that will load DST",
    )
    assert not (tmp_path / "out").exists()


def test_standalone_with_world_size_writes_for_it(capsys, src, tmp_path):
    argv = ["convert", str(src), str(tmp_path / "out"), "--to", "sharded", "--world-size", "3"]
    assert run([*argv, "--json"]) == 0
    captured = capsys.readouterr()
    assert '"world_size": 3' in captured.out and "note" not in captured.err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".metadata"] + [
        f"__{r}_0.distcp" for r in range(3)
    ]


def _asking(to: str, world_size: int | None) -> ConvertRequest:
    return ConvertRequest(src="src", dst="dst", to=to, world_size=world_size)


def test_under_a_launch_the_launchs_world_size_is_used_and_said_once_by_rank_0(capsys):
    # A Runtime with a mesh is what launch() yields under torchrun; no collective is made here.
    launched = Runtime(rank=0, world_size=3, mesh=object())
    assert _target_world_size(_asking("sharded", None), launched) == 3
    assert capsys.readouterr().err == (
        "shardckpt: note: writing DST for world size 3, the launch's "
        "(pass --world-size M for another)\n"
    )
    assert (
        _target_world_size(_asking("local", None), Runtime(rank=1, world_size=3, mesh=object()))
        == 3
    )
    assert _target_world_size(_asking("sharded", 5), launched) == 5
    assert capsys.readouterr().err == ""
