"""The README's Usage lines run as written, in order, on the demo's checkpoint."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from user_shell import REPO, user_env

README = REPO / "README.md"


def section(text: str, title: str) -> str:
    """Return the body of the README's ``## title`` section."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"README.md has no '## {title}' section"
    return match.group(1)


def bash_lines(text: str) -> list[str]:
    """Return the command lines of every ```bash block in ``text`` (no comments)."""
    blocks = re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M)
    return [
        line.strip()
        for block in blocks
        for line in block.splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]


def test_the_setup_step_puts_shardckpt_on_path_and_silences_torchrun():
    lines = bash_lines(section(README.read_text(), "Put `shardckpt` on your PATH"))
    assert lines[:2] == [
        "source .venv/bin/activate",
        "export OMP_NUM_THREADS=1   # or torchrun prints a 4-line warning about it at every launch",
    ]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_every_usage_line_runs_as_written_after_the_demo(tmp_path):
    lines = bash_lines(section(README.read_text(), "Usage"))
    assert len(lines) >= 10 and any(line.startswith("torchrun ") for line in lines)
    # The checkout as the README leaves it: examples/ in place, and .demo/ckpt-dcp
    # made by the demo's own first step.
    (tmp_path / "examples").symlink_to(REPO / "examples")
    # What the setup step does: these wrappers stand for `source .venv/bin/activate`.
    env = user_env(tmp_path / ".bin", OMP_NUM_THREADS="1")
    demo = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        + ["examples/make_checkpoint.py", ".demo/ckpt-dcp", "--steps", "3"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert demo.returncode == 0, demo.stderr
    # One shell, as a user pastes the lines; each line's output and exit code kept apart.
    logs = tmp_path / "logs"
    logs.mkdir()
    script = "".join(
        f'{{\n{line}\n}} >"{logs}/{i}.log" 2>&1 </dev/null; echo "{i} $?" >>"{logs}/rc"\n'
        for i, line in enumerate(lines)
    )
    shell = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=380
    )
    assert shell.returncode == 0, shell.stderr
    codes = dict(row.split() for row in (logs / "rc").read_text().splitlines())
    failed = [
        f"{lines[i]}\n  -> exit {codes.get(str(i))}\n{(logs / f'{i}.log').read_text()}"
        for i in range(len(lines))
        if codes.get(str(i)) != "0"
    ]
    assert failed == [], "\n".join(failed)
    # The setup step's OMP_NUM_THREADS keeps torchrun's banner away.
    output = "".join((logs / f"{i}.log").read_text() for i in range(len(lines)))
    assert "Setting OMP_NUM_THREADS" not in output
