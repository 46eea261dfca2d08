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
    """Return every option name ``shardckpt COMMAND`` lists in its --help (not the old spellings)."""
    click_command = typer.main.get_command(app).commands[command]
    return {
        name
        for p in click_command.params
        for name in (*click_command.listed_names(p), *p.secondary_opts)
    }


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
    (["inspect", "@notes.txt"], "--from"),
    (["diff", "@notes.txt", "@small.pt"], "--from-a"),
    (["diff", "@small.pt", "@notes.txt"], "--from-b"),
    (["convert", "@small-dcp", "@out.pt", "--to", "full", "--from", "torch"], "--from"),
    (["inspect", "@small-dcp", "--from", "torch"], "--from"),
    (["diff", "@small-dcp", "@small.pt", "--from-a", "torch"], "--from-a"),
    (["diff", "@small.pt", "@small-dcp", "--from-b", "torch"], "--from-b"),
    (["inspect", "@plain.pt", "--from", "torch"], "--from"),
    (["convert", "@plain.pt", "@out.pt", "--to", "full", "--from", "torch"], "--from"),
    (["inspect", "@small.pt", "--from", "safetensors"], "--from"),
    (["convert", "@small.pt", "@o.pt", "--to", "full", "--from", "safetensors"], "--from"),
    (["diff", "@small.pt", "@small.pt", "--from-b", "safetensors"], "--from-b"),
    (["inspect", "@empty-dir", "--from", "dcp"], "--from"),
    (["convert", "@empty-dir", "@out.pt", "--to", "full", "--from", "dcp"], "--from"),
    (["diff", "@empty-dir", "@small.pt", "--from-a", "dcp"], "--from-a"),
    (["inspect", "@empty-dir", "--from", "hf"], "--from"),
    (["convert", "@empty-dir", "@out.pt", "--to", "full", "--from", "hf"], "--from"),
    (["inspect", "@fsdp2-ranks/rank_0.pt"], "--from"),
    (["convert", "@fsdp2-ranks/rank_0.pt", "@o.pt", "--to", "full"], "--from"),
    (["diff", "@small.pt", "@fsdp2-ranks/rank_0.pt"], "--from-b"),
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


# The source-format option is --from everywhere (diff: --from-a, --from-b); inspect's,
# verify's and diff's old spellings still work, unlisted, with a note (issue 35 item 7).
OLD_SPELLINGS = [
    (["inspect", "@small.pt", "--format", "torch"], ["--format is spelled --from now"]),
    (["inspect", "@small.pt", "--format=torch"], ["--format is spelled --from now"]),
    (["verify", "@small.pt", "-q", "--format", "torch"], ["--format is spelled --from now"]),
    (
        ["diff", "@small.pt", "@small-dcp", "-q", "--format-a", "torch", "--format-b", "dcp"],
        ["--format-a is spelled --from-a now", "--format-b is spelled --from-b now"],
    ),
]


@pytest.mark.parametrize(("argv", "notes"), OLD_SPELLINGS, ids=lambda v: " ".join(v))
def test_an_old_source_format_spelling_still_works_with_a_note(capsys, files, argv, notes):
    code = run([str(files / a[1:]) if a.startswith("@") else a for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    command, old = argv[0], [a.partition("=")[0] for a in argv if a.startswith("--format")]
    assert code == 0, err
    assert err == [
        f"shardckpt: note: {note} ({command} {name} still works)" for note, name in zip(notes, old)
    ]


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["inspect", "@small.pt", "--from", "torch", "--format", "torch"], "--from and --format"),
        (["verify", "@small.pt", "--format", "torch", "--from", "torch"], "--format and --from"),
        (
            ["diff", "@small.pt", "@small.pt", "--from-b", "torch", "--format-b", "torch"],
            "--from-b and --format-b",
        ),  # fmt: skip
    ],
)
def test_both_spellings_of_the_source_format_are_refused(capsys, files, argv, line):
    code, err = error_line(capsys, [files / a[1:] if a.startswith("@") else a for a in argv])
    assert (code, err) == (2, f"shardckpt: error: {line} both given: keep one of them")


@pytest.mark.parametrize(
    ("command", "listed", "unlisted"),
    [
        ("inspect", {"--from"}, {"--format"}),
        ("verify", {"--from"}, {"--format"}),
        ("diff", {"--from-a", "--from-b"}, {"--format", "--format-a", "--format-b"}),
        ("convert", {"--from", "--format"}, set()),
    ],
)
def test_help_lists_the_source_format_as_from(capsys, command, listed, unlisted):
    with pytest.raises(SystemExit):
        app([command, "--help"])
    shown = set(_OPTION.findall(capsys.readouterr().out))
    assert listed <= shown and not (unlisted & shown), shown
