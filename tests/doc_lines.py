"""Run documented command lines as a user pastes them, most of them in this process.

A plain ``shardckpt …`` line runs in-process (``cli.run``): a few seconds of Python and
torch start-up saved per line; so does ``shardckpt … && echo WORD``, with the echo done
as bash would. A plain ``torchrun …`` line (or ``python -m torch.distributed.run …``)
runs torchrun's agent forked warm (``warm_cli.run_torchrun``), with the user's
environment; the ranks it starts are fresh interpreters, as for any user. A line that
needs a shell (a pipe, any other ``&&``, a variable set before a launch) runs in bash
with the user's PATH (``user_shell.user_env``).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import warm_cli
from user_shell import REPO, user_env

from shardckpt.cli.app import run


def workspace(tmp_path: Path, demo: Path) -> Path:
    """Return a checkout-like directory: examples/ and a fresh .demo/ holding the checkpoint."""
    (tmp_path / "examples").symlink_to(REPO / "examples")
    (tmp_path / ".demo").mkdir()
    (tmp_path / ".demo" / "ckpt-dcp").symlink_to(demo)
    return tmp_path


# ``CMD && echo WORD``: bash runs the echo when CMD exits 0 and its exit code is then 0.
_AND_ECHO = re.compile(r"^(?P<command>[^|&;<>]+?) && echo (?P<word>\w+)$")
# How a line starts torchrun: the script on PATH, or the module.
_TORCHRUN = (["torchrun"], ["python", "-m", "torch.distributed.run"])


def run_line(line: str, cwd: Path, env: dict[str, str], capfd) -> tuple[int, str]:
    """Run one command line as a user would; return its exit code and output."""
    and_echo = _AND_ECHO.match(line)
    if and_echo and and_echo["command"].startswith(("shardckpt ", "torchrun ")):
        # As bash would run it, without a second interpreter's start-up for the echo.
        code, output = run_line(and_echo["command"], cwd, env, capfd)
        return code, output + (f"{and_echo['word']}\n" if code == 0 else "")
    words = shlex.split(line, comments=True)
    assignments = {}
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        name, _, value = words.pop(0).partition("=")
        assignments[name] = value
    plain = not re.search(r"[|&;<>]", line)
    launcher = next((w for w in _TORCHRUN if words[: len(w)] == w), None)
    if plain and launcher and not assignments:
        done = warm_cli.run_torchrun(words[len(launcher) :], env=env, cwd=cwd, timeout=120)
        return done.returncode, done.stdout + done.stderr
    in_process = words[0] == "shardckpt" and plain
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


def run_all(lines: list[str], cwd: Path, capfd, outputs: list[str] | None = None) -> list[str]:
    """Run ``lines`` in order in ``cwd``; return a report of each line that failed.

    Each line's output is appended to ``outputs`` when given.
    """
    env = user_env(cwd / ".bin", OMP_NUM_THREADS="1")
    failed = []
    for line in lines:
        code, output = run_line(line, cwd, env, capfd)
        if outputs is not None:
            outputs.append(output)
        if code != 0:
            failed.append(f"{line}\n  -> exit {code}\n{output}")
    return failed


def printed_help(command: str, columns: int = 80) -> str:
    """Return ``shardckpt COMMAND --help`` as a terminal of ``columns`` columns shows it."""
    import typer

    from shardckpt.cli.app import app

    click_command = typer.main.get_command(app).commands[command]
    ctx = click_command.context_class(
        click_command, info_name=f"shardckpt {command}", terminal_width=columns
    )
    return click_command.get_help(ctx)


def printed_examples(command: str, columns: int = 80) -> list[str]:
    """Return the lines of the Examples section of ``printed_help``, as printed (stripped)."""
    text = printed_help(command, columns)
    section = text[text.index("\n  Examples") :]
    return [line.strip() for line in section.splitlines()[1:] if line.strip()]
