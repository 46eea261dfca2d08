"""Every example command in docs/ and in ``--help`` runs as written on the demo's checkpoint.

The docs promise that their ```bash blocks run, in order, from the root of a checkout
after ``bash scripts/demo.sh``; each page (and the ``--help`` epilogs, convert's then
diff's then inspect's then verify's) starts from a directory holding only the demo's
``.demo/ckpt-dcp``, and later lines use what earlier lines wrote. Lines run as
``doc_lines`` runs them (most in this process).
Commands in other fences (```text) are samples of output, or multi-node launches that
one machine cannot run; a command line outside a ```bash block is refused here unless
it launches on several nodes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from doc_lines import printed_examples, run_all, workspace
from user_shell import REPO

DOCS = REPO / "docs"
# Pages about a trainer's own directory run on what that trainer saves, not on the
# demo; their commands are exercised by that trainer's tests.
NOT_ON_THE_DEMO = ("trainers",)
COMMAND = re.compile(
    r"^\s*(?:[A-Z_]+=\S+\s+)*(shardckpt|torchrun|python -m torch\.distributed\.run)\s"
)
FENCE = re.compile(r"^ *```(\w*)\n(.*?)^ *```", re.S | re.M)


def pages() -> list[Path]:
    """Return every docs page whose commands run on the demo."""
    return [
        p
        for p in sorted(DOCS.rglob("*.md"))
        if not any(part in NOT_ON_THE_DEMO for part in p.relative_to(DOCS).parts)
    ]


def commands(text: str) -> list[str]:
    """Return the command lines of ``text``'s ```bash blocks, in order."""
    return [
        line.strip()
        for lang, body in FENCE.findall(text)
        if lang == "bash"
        for line in body.splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]


def epilog_commands() -> list[str]:
    """Return the example lines convert's, diff's, inspect's and verify's ``--help`` print at 80 columns.

    As printed, not as written in the source: a line click re-wrapped would not run.
    """
    lines = [
        line
        for command in ("convert", "diff", "inspect", "verify")
        for line in printed_examples(command)
        if COMMAND.match(line)
    ]
    return [line for line in lines if "--nnodes" not in line]


def test_every_page_with_commands_is_found():
    found = {p.name for p in pages() if commands(p.read_text())}
    assert {"commands.md", "optimizer.md", "torchrun.md"} <= found


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_a_command_is_shown_only_in_a_block_that_runs(page):
    stray = [
        line
        for lang, body in FENCE.findall(page.read_text())
        if lang != "bash"
        for line in body.splitlines()
        if COMMAND.match(line) and "--nnodes" not in line
    ]
    assert stray == [], f"{page.name}: commands outside a ```bash block (not run by this test)"


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "page",
    [p for p in pages() if commands(p.read_text())],
    ids=lambda p: str(p.relative_to(DOCS)),
)
def test_every_command_of_a_docs_page_runs_on_the_demo(page, demo_ckpt, tmp_path, capfd):
    lines = commands(page.read_text())
    assert run_all(lines, workspace(tmp_path, demo_ckpt), capfd) == []


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_every_help_example_runs_on_the_demo(demo_ckpt, tmp_path, capfd):
    lines = epilog_commands()
    assert len(lines) >= 18 and sum(line.startswith("torchrun") for line in lines) == 2
    assert run_all(lines, workspace(tmp_path, demo_ckpt), capfd) == []


def python_blocks(text: str) -> list[str]:
    """Return the bodies of ``text``'s ```python blocks, in order."""
    return [body for lang, body in FENCE.findall(text) if lang == "python"]


@pytest.mark.slow
def test_the_python_api_page_runs_on_the_demo(demo_ckpt, tmp_path):
    # The other pages' python blocks are fragments of a training job, shown, not run.
    cwd = workspace(tmp_path, demo_ckpt)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for block in python_blocks((DOCS / "python-api.md").read_text()):
        done = subprocess.run(
            [sys.executable, "-c", block], cwd=cwd, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, f"{block}\n{done.stdout}{done.stderr}"
        assert (cwd / ".demo" / "api-ckpt-3" / ".metadata").is_file()


def test_the_python_api_page_has_a_block_that_runs():
    assert python_blocks((DOCS / "python-api.md").read_text())


def test_a_line_that_fails_is_reported_in_process_and_in_bash(tmp_path, capfd):
    lines = ["shardckpt inspect .demo/missing", "shardckpt inspect .demo/missing -q && true"]
    failed = run_all(lines, tmp_path, capfd)
    assert [f.splitlines()[:2] for f in failed] == [
        [lines[0], "  -> exit 3"],
        [lines[1], "  -> exit 2"],
    ]


def demo_outputs() -> set[str]:
    """Return the paths ``scripts/demo.sh`` leaves in ``.demo/`` (``"$demo/NAME"`` it names)."""
    text = (REPO / "scripts" / "demo.sh").read_text()
    return {f".demo/{name}" for name in re.findall(r'"\$demo/([\w.-]+)"', text)}


def convert_dst(line: str) -> str | None:
    """Return the DST of a ``shardckpt convert SRC DST`` line (standalone or under torchrun)."""
    words = line.split()
    if "convert" not in words:
        return None
    at = words.index("convert")
    args = [w for w in words[at + 1 :] if not w.startswith("-")]
    return args[1] if len(args) > 1 else None


def test_no_example_writes_over_what_the_demo_left():
    """The examples say they run as written after the demo: one whose DST the demo already
    wrote would stop at "already exists" (exit 5), as convert's first one did."""
    made = demo_outputs()
    assert {".demo/ckpt-dcp", ".demo/full.pt"} <= made
    from test_readme import README, bash_lines, section

    sources = {
        "--help": epilog_commands(),
        "README": bash_lines(section(README.read_text(), "Usage")),
        **{str(p.relative_to(DOCS)): commands(p.read_text()) for p in pages()},
    }
    clashes = [
        f"{where}: {line}"
        for where, lines in sources.items()
        for line in lines
        if convert_dst(line) in made and "--overwrite" not in line.split()
    ]
    assert clashes == []
