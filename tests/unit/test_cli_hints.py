"""Every hint names an option of the command that printed it (issue 10, item 4).

Each case runs the real CLI on real files and checks the exact option its hint names,
then that every ``--option`` in the line is one of that command's own options.
"""

from __future__ import annotations

import pickle
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp
import typer
from optim_models import tiny

from shardckpt.cli.app import app, run
from shardckpt.core.errors import SRC_FORMAT

_OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def options_of(command: str) -> set[str]:
    """Return every option name ``shardckpt COMMAND`` accepts, as its --help lists them."""
    click_command = typer.main.get_command(app).commands[command]
    return {name for p in click_command.params for name in (*p.opts, *p.secondary_opts)}


def error_line(capsys, argv) -> tuple[int, str]:
    code = run([str(a) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


def assert_names_own_options(command: str, line: str) -> None:
    named = set(_OPTION.findall(line))
    assert named, line
    assert named <= options_of(command), (named - options_of(command), line)
    assert SRC_FORMAT not in line


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("hints")
    sd = {"model": {"w": torch.arange(21.0).reshape(7, 3)}, "epoch": 1}
    torch.save(sd, root / "small.pt")
    dcp.save(sd, checkpoint_id=root / "small-dcp", no_dist=True)
    (root / "notes.txt").write_text("not a checkpoint\n")
    (root / "plain.pt").write_bytes(pickle.dumps({"a": 1}, protocol=2))
    (root / "empty-dir").mkdir()
    torch.save({"model": tiny().state_dict()}, root / "tiny.pt")
    for fmt in ("fsdp2-ranks", "fsdp1-sharded"):
        argv = ["convert", root / "tiny.pt", root / fmt, "--to", "local", "--format", fmt]
        assert (
            run([str(a) for a in argv] + ["--world-size", "2", "--model", "optim_models:tiny"]) == 0
        )
    return root


# (argv, "@name" for a file of the fixture; the option the hint must name)
SOURCE_FORMAT_HINTS = [
    (["convert", "@notes.txt", "@out.pt", "--to", "full"], "--from"),
    (["inspect", "@notes.txt"], "--format"),
    (["diff", "@notes.txt", "@small.pt"], "--format-a"),
    (["diff", "@small.pt", "@notes.txt"], "--format-b"),
    (["convert", "@small-dcp", "@out.pt", "--to", "full", "--from", "torch"], "--from"),
    (["inspect", "@small-dcp", "--format", "torch"], "--format"),
    (["diff", "@small-dcp", "@small.pt", "--format-a", "torch"], "--format-a"),
    (["diff", "@small.pt", "@small-dcp", "--format-b", "torch"], "--format-b"),
    (["inspect", "@plain.pt", "--format", "torch"], "--format"),
    (["convert", "@plain.pt", "@out.pt", "--to", "full", "--from", "torch"], "--from"),
    (["inspect", "@small.pt", "--format", "safetensors"], "--format"),
    (["convert", "@small.pt", "@o.pt", "--to", "full", "--from", "safetensors"], "--from"),
    (["diff", "@small.pt", "@small.pt", "--format-b", "safetensors"], "--format-b"),
    (["inspect", "@empty-dir", "--format", "dcp"], "--format"),
    (["convert", "@empty-dir", "@out.pt", "--to", "full", "--from", "dcp"], "--from"),
    (["diff", "@empty-dir", "@small.pt", "--format-a", "dcp"], "--format-a"),
    (["inspect", "@empty-dir", "--format", "hf"], "--format"),
    (["convert", "@empty-dir", "@out.pt", "--to", "full", "--from", "hf"], "--from"),
    (["inspect", "@fsdp2-ranks/rank_0.pt"], "--format"),
    (["convert", "@fsdp2-ranks/rank_0.pt", "@o.pt", "--to", "full"], "--from"),
    (["diff", "@small.pt", "@fsdp2-ranks/rank_0.pt"], "--format-b"),
    (
        [
            "convert",
            "@fsdp1-sharded",
            "@o.pt",
            "--to",
            "full",
            "--from",
            "fsdp1-local",
            "--model",
            "optim_models:tiny",
        ],
        "--from",
    ),
]


@pytest.mark.parametrize(
    ("argv", "option"), SOURCE_FORMAT_HINTS, ids=lambda v: " ".join(v) if isinstance(v, list) else v
)
def test_a_source_format_hint_names_the_commands_own_option(capsys, files, argv, option):
    command = argv[0]
    code, line = error_line(capsys, [files / a[1:] if a.startswith("@") else a for a in argv])
    assert code == 3, line
    assert re.search(rf"{option}(?![\w-])", line), line
    assert_names_own_options(command, line)


OTHER_HINTS = [
    (["convert", "@small.pt", "@out.pt", "--to", "full", "--format", "dcp"], "--to"),
    (["convert", "@small.pt", "@out", "--to", "local", "--format", "fsdp1-local"], "--model"),
    (
        [
            "convert",
            "@small.pt",
            "@out",
            "--to",
            "sharded",
            "--world-size",
            "1",
            "--max-shard-size",
            "1GB",
        ],
        "--format",
    ),
    (["convert", "@small.pt", "@out", "--to", "sharded"], "--world-size"),
    (["convert", "@small.pt", "@out.safetensors", "--to", "full", "--format", "torch"], "--format"),
    (["convert", "@small.pt", "@out.pt", "--to", "full", "--cast-optim"], "--dtype"),
    (["convert", "@small.pt", "@tiny.pt", "--to", "full"], "--overwrite"),
    (["convert", "@small.pt", "@o", "--to", "local", "--format", "fsdp1-sharded"], "--world-size"),
]


@pytest.mark.parametrize(
    ("argv", "option"), OTHER_HINTS, ids=lambda v: " ".join(v) if isinstance(v, list) else v
)
def test_every_other_hint_names_the_commands_own_option(capsys, files, argv, option):
    command = argv[0]
    code, line = error_line(capsys, [files / a[1:] if a.startswith("@") else a for a in argv])
    assert code in (2, 3, 5), line
    assert re.search(rf"{option}(?![\w-])", line), line
    assert_names_own_options(command, line)
