"""Every example command in docs/ and in ``--help`` runs as written on the demo's checkpoint.

The docs promise that their ```bash blocks run, in order, from the root of a checkout
after ``bash scripts/demo.sh``; each page (and the ``--help`` epilogs, convert's then
diff's then inspect's) starts from a directory holding only the demo's
``.demo/ckpt-dcp``, and later lines use what earlier lines wrote. A plain
``shardckpt …`` line runs in this process (``cli.run``: seconds saved per line); a line
that needs a shell or a launch (``torchrun``, ``&&``) runs in bash with the user's PATH.
Commands in other fences (```text) are samples of output, or multi-node launches that
one machine cannot run; a command line outside a ```bash block is refused here unless
it launches on several nodes.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from reference import make_fsdp2_dcp
from user_shell import REPO, user_env

from shardckpt.cli import run
from shardckpt.commands import convert, diff, inspect

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
    """Return the example lines of convert's, diff's and inspect's ``--help``, in that order."""
    lines = [
        line.strip()
        for module in (convert, diff, inspect)
        for line in module.EPILOG.splitlines()
        if COMMAND.match(line)
    ]
    return [line for line in lines if "--nnodes" not in line]


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    """Return a directory whose ``.demo/ckpt-dcp`` is the demo's checkpoint (FSDP2, 2 ranks, 3 steps)."""
    root = tmp_path_factory.mktemp("demo")
    make_fsdp2_dcp(root / "ckpt-dcp", root / "ref.pt", world_size=2, steps=3)
    return root / "ckpt-dcp"


def workspace(tmp_path: Path, demo: Path) -> Path:
    """Return a checkout-like directory: examples/ and a fresh .demo/ holding the checkpoint."""
    (tmp_path / "examples").symlink_to(REPO / "examples")
    (tmp_path / ".demo").mkdir()
    (tmp_path / ".demo" / "ckpt-dcp").symlink_to(demo)
    return tmp_path


def run_line(line: str, cwd: Path, env: dict[str, str], capfd) -> tuple[int, str]:
    """Run one command line as a user would; return its exit code and output."""
    words = shlex.split(line)
    assignments = {}
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        name, _, value = words.pop(0).partition("=")
        assignments[name] = value
    in_process = words[0] == "shardckpt" and not re.search(r"[|&;<>]", line)
    if not in_process:
        done = subprocess.run(
            ["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
        )
        return done.returncode, done.stdout + done.stderr
    added = [os.path.join(cwd, p) for p in assignments.pop("PYTHONPATH", "").split(":") if p]
    assert not assignments, f"{line}: only PYTHONPATH= is understood in-process"
    old_cwd, old_path = os.getcwd(), list(sys.path)
    os.chdir(cwd)
    sys.path[:0] = added
    try:
        code = run(words[1:])
    finally:
        os.chdir(old_cwd)
        sys.path[:] = old_path
    out, err = capfd.readouterr()
    return code, out + err


def run_all(lines: list[str], cwd: Path, capfd) -> list[str]:
    """Run ``lines`` in order in ``cwd``; return a report of each line that failed."""
    env = user_env(cwd / ".bin", OMP_NUM_THREADS="1")
    failed = []
    for line in lines:
        code, output = run_line(line, cwd, env, capfd)
        if code != 0:
            failed.append(f"{line}\n  -> exit {code}\n{output}")
    return failed


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
def test_every_command_of_a_docs_page_runs_on_the_demo(page, demo, tmp_path, capfd):
    lines = commands(page.read_text())
    assert run_all(lines, workspace(tmp_path, demo), capfd) == []


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_every_help_example_runs_on_the_demo(demo, tmp_path, capfd):
    lines = epilog_commands()
    assert len(lines) >= 15 and sum(line.startswith("torchrun") for line in lines) == 2
    assert run_all(lines, workspace(tmp_path, demo), capfd) == []


def test_a_line_that_fails_is_reported_in_process_and_in_bash(tmp_path, capfd):
    lines = ["shardckpt inspect .demo/missing", "shardckpt inspect .demo/missing -q && true"]
    failed = run_all(lines, tmp_path, capfd)
    assert [f.splitlines()[:2] for f in failed] == [
        [lines[0], "  -> exit 3"],
        [lines[1], "  -> exit 2"],
    ]
