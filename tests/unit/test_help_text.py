"""``--help`` that can be copied from (issue 23, item 5).

Examples print as written at any width (click re-wrapped them at 80 columns, splitting
``--world-`` / ``size 4``); the usage line and the arguments name SRC and DST plainly;
no metavar or default is said twice; ``convert --help`` fits two screens, not four.
"""

from __future__ import annotations

import re

import pytest
from doc_lines import printed_examples, printed_help

from shardckpt.cli import convert, diff, inspect
from shardckpt.cli.app import run

COMMANDS = {"convert": convert, "diff": diff, "inspect": inspect}


def written_examples(module) -> list[str]:
    """Return the example command lines of a command's epilog, as written in the source."""
    return [line.strip() for line in module.EPILOG.splitlines() if line.startswith("  ")]


@pytest.mark.parametrize("name", COMMANDS)
@pytest.mark.parametrize("columns", [60, 80, 200])
def test_each_example_prints_on_one_line_as_written(name, columns):
    written = written_examples(COMMANDS[name])
    assert len(written) >= 3 and any(len(line) > 80 for line in written) == (name == "convert")
    printed = printed_examples(name, columns)
    assert [line for line in printed if line in written] == written


@pytest.mark.parametrize(
    ("name", "usage"),
    [
        ("convert", "Usage: shardckpt convert [OPTIONS] SRC DST"),
        ("inspect", "Usage: shardckpt inspect [OPTIONS] SRC"),
        ("diff", "Usage: shardckpt diff [OPTIONS] A B"),
    ],
)
def test_the_usage_line_and_arguments_name_them_plainly(capsys, monkeypatch, name, usage):
    monkeypatch.setenv("COLUMNS", "80")
    assert run([name, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == usage
    arguments = out[out.index("Arguments:") : out.index("Options:")]
    assert "<str>" not in arguments and "[required]" not in arguments
    assert re.search(rf"^  {usage.split()[-1]}  \S", arguments, re.M)


def option_rows(help_text: str) -> list[str]:
    """Return each option's row of a help text: its names and metavar, then its help, joined."""
    body = help_text[help_text.index("Options:") : help_text.index("\n  Examples")]
    rows: list[str] = []
    for line in body.splitlines()[1:]:
        if line.startswith("  -"):
            rows.append(line.strip())
        elif line.strip():
            rows[-1] += " " + line.strip()
    return rows


@pytest.mark.parametrize("name", COMMANDS)
def test_no_option_says_its_metavar_or_its_default_twice(name):
    for row in option_rows(printed_help(name, 200)):
        head, _, rest = row.partition("  ")
        metavar = head.split()[-1]
        # `--model pkg.module:factory  pkg.module:factory returning ...` said it twice.
        assert not rest.strip().startswith(metavar), row
        assert rest.lower().count("default") <= 1, row


def test_convert_help_fits_two_screens_at_80_columns():
    assert len(printed_help("convert", 80).splitlines()) <= 90


def test_the_apps_example_prints_on_one_line(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")
    assert run(["--help"]) == 0
    line = "torchrun --nproc-per-node 4 -m shardckpt convert ckpt/step-100 full.pt --to full"
    assert f"\n    {line}\n" in capsys.readouterr().out
