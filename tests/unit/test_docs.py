"""docs/ against the program: every documented option exists, every option is documented.

docs/commands.md has one section per command, each with a table of its options
(``| `--opt VALUE` | what it does |``); these tests read those tables and compare them
with the options Typer builds for the command, and the formats the docs name with the
formats shardckpt knows.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import typer

from shardckpt.cli.app import app, run
from shardckpt.formats import FORMATS

DOCS = Path(__file__).resolve().parents[2] / "docs"
COMMANDS = ("inspect", "convert", "diff", "verify")


def _sections() -> dict[str, str]:
    """Return each command's section of docs/commands.md, by command name."""
    text = (DOCS / "commands.md").read_text()
    parts = re.split(r"^## `shardckpt (\w+)[^`]*`$", text, flags=re.M)
    return {name: body.split("\n## ", 1)[0] for name, body in zip(parts[1::2], parts[2::2])}


def _documented_options(section: str) -> set[str]:
    """Return the options named in the first cell of the section's table rows."""
    options = set()
    for line in section.splitlines():
        if not line.startswith("| `-"):
            continue
        first = line.split("|")[1]
        options |= set(re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", first))
    return options


def _real_options(name: str) -> set[str]:
    command = typer.main.get_command(app).commands[name]
    return {opt for p in command.params for opt in (*p.opts, *p.secondary_opts) if opt[0] == "-"}


def test_commands_md_has_a_section_for_every_command():
    assert set(_sections()) == set(COMMANDS)


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_commands_md_documents_exists(name):
    documented = _documented_options(_sections()[name])
    assert documented, f"no option table found for {name}"
    assert documented <= _real_options(name), documented - _real_options(name)


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_of_a_command_is_documented(name):
    documented = _documented_options(_sections()[name])
    missing = _real_options(name) - documented - {"--help", "-h", "--version"}  # in the prose
    assert not missing, f"options of {name} missing from docs/commands.md: {sorted(missing)}"


def test_the_formats_docs_list_are_the_formats_shardckpt_knows():
    listed = {
        m.group(1)
        for m in re.finditer(r"^\| \[`([a-z0-9-]+)`\]", (DOCS / "formats.md").read_text(), re.M)
    }
    assert listed == set(FORMATS)


def _json_example() -> dict:
    block = re.search(r"`--json` \(schema 1\).*?```json\n(.*?)```", _sections()["inspect"], re.S)
    assert block, "no inspect --json example in docs/commands.md"
    return json.loads(block.group(1))


def test_the_inspect_json_example_is_what_inspect_prints_for_the_example_checkpoint(
    fsdp2_ckpt, capsys
):
    """The example is documented as the FSDP2 checkpoint examples/make_checkpoint.py saves at 4."""
    documented = _json_example()
    assert run(["inspect", str(fsdp2_ckpt.dcp), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    for key in ("schema", "format", "world_size", "optimizers", "totals", "warnings"):
        assert printed[key] == documented[key], key
    entries = {tuple(e["path"]): e for e in printed["entries"]}
    for entry in documented["entries"]:
        assert entries[tuple(entry["path"])] == entry
