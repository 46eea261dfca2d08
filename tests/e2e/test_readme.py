"""The README's Usage lines run as written, in order, on the demo's checkpoint."""

from __future__ import annotations

import re
import sys

import pytest
import torch
from doc_lines import run_all, workspace
from user_shell import REPO

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
def test_every_usage_line_runs_as_written_after_the_demo(demo_ckpt, tmp_path, capfd):
    lines = bash_lines(section(README.read_text(), "Usage"))
    assert len(lines) >= 10 and any(line.startswith("torchrun ") for line in lines)
    # The checkout as the README leaves it: examples/ in place and .demo/ckpt-dcp, the
    # checkpoint the demo's first step makes (made here by the same code on pooled ranks).
    outputs: list[str] = []
    assert run_all(lines, workspace(tmp_path, demo_ckpt), capfd, outputs) == []
    # The setup step's OMP_NUM_THREADS keeps torchrun's banner away.
    assert "Setting OMP_NUM_THREADS" not in "".join(outputs)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_evaluation_export_loads_into_the_model_with_strict(demo_ckpt, tmp_path, capfd):
    from safetensors.torch import load_file

    (line,) = [
        line
        for line in bash_lines(section(README.read_text(), "Usage"))
        if "--only model" in line and ".safetensors" in line
    ]
    cwd = workspace(tmp_path, demo_ckpt)
    assert run_all([line], cwd, capfd) == []
    sys.path.insert(0, str(REPO / "examples"))
    try:
        from make_checkpoint import build_model
    finally:
        sys.path.remove(str(REPO / "examples"))
    model = build_model(seed=1)
    exported = load_file(cwd / ".demo" / "model.safetensors")
    model.load_state_dict(exported, strict=True)
    ref = torch.load(demo_ckpt.parent / "ref.pt", weights_only=True)["model"]
    assert sorted(exported) == sorted(ref)
    for name, value in model.state_dict().items():
        assert torch.equal(value, ref[name]), name
