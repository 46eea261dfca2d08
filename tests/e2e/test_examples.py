"""Every example marked `cpu-ok` in its first five lines runs, as a user runs it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from user_shell import REPO, user_env

EXAMPLES = REPO / "examples"


def head(path: Path, lines: int = 5) -> str:
    """Return the first ``lines`` lines of ``path``."""
    return "".join(path.read_text().splitlines(keepends=True)[:lines])


def cpu_ok_examples() -> list[Path]:
    """Return the scripts under examples/ that say `cpu-ok` in their first five lines.

    Only ``.py`` and ``.sh`` files: another test importing an example (``make_checkpoint``)
    may be writing its ``__pycache__`` while this one collects.
    """
    scripts = (p for p in EXAMPLES.rglob("*") if p.suffix in (".py", ".sh") and p.is_file())
    return sorted(p for p in scripts if "cpu-ok" in head(p))


def command_for(path: Path) -> list[str]:
    """Return how a user starts the example: bash for .sh, python for .py."""
    if path.suffix == ".sh":
        return ["bash", str(path)]
    if path.suffix == ".py":
        return [sys.executable, str(path)]
    raise AssertionError(f"{path}: cpu-ok example of unknown kind (expected .sh or .py)")


def run_example(argv: list[str], cwd: Path, timeout: float = 150, **env: str):
    """Run an example in ``cwd`` with shardckpt on PATH; return the finished process."""
    return subprocess.run(
        argv,
        cwd=cwd,
        env=user_env(cwd / ".bin", **env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_every_file_under_examples_says_whether_it_runs_on_cpu():
    # An example that loses its marker would silently drop out of the suite: every
    # file is either a cpu-ok example or a helper that says what runs it.
    unmarked = [
        p.relative_to(REPO)
        for p in EXAMPLES.rglob("*")
        if p.is_file()
        and "__pycache__" not in p.parts
        and not any(marker in head(p) for marker in ("cpu-ok", "helper:"))
    ]
    assert unmarked == []
    names = {p.name for p in cpu_ok_examples()}
    assert {
        "reshard_and_resume.sh",
        "ci_check_conversion.sh",
        "export_hf_eval.sh",
        "ddp_to_fsdp2.sh",
    } <= names


@pytest.mark.slow
@pytest.mark.timeout(170)
@pytest.mark.parametrize("example", cpu_ok_examples(), ids=lambda p: p.name)
def test_cpu_ok_example_runs_to_the_end(example, tmp_path):
    start = time.monotonic()
    proc = run_example(command_for(example), tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    # The examples set OMP_NUM_THREADS themselves, so torchrun's banner never shows.
    assert "Setting OMP_NUM_THREADS" not in output
    print(f"{example.name}: {time.monotonic() - start:.1f} s")


def test_check_losses_fails_when_the_resumed_run_does_not_continue(tmp_path):
    ref = tmp_path / "ref.json"
    ref.write_text('{"4": 35.7086411, "5": 32.010231}')
    cases = {
        '{"4": 35.7086360, "5": 32.0102285}': 0,  # a few ulps: another sum order
        '{"4": 35.7086411, "5": 32.03}': 1,  # step 5 off: optimizer state not resumed
        '{"4": 35.7086411, "6": 30.0}': 1,  # a step the reference never ran
        "{}": 1,
    }
    for resumed, code in cases.items():
        (tmp_path / "resumed.json").write_text(resumed)
        proc = subprocess.run(
            [sys.executable, EXAMPLES / "check_losses.py", ref, tmp_path / "resumed.json"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert proc.returncode == code, (resumed, proc.stdout, proc.stderr)


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_ci_step_fails_the_pipeline_when_the_conversion_differs_from_the_reference(
    fsdp2_ckpt, tmp_path
):
    ref = torch.load(fsdp2_ckpt.ref, weights_only=True)
    ref["model"]["blocks.1.fc_in.bias"][2] += 1e-3
    torch.save(ref, tmp_path / "bad-ref.pt")
    script = str(EXAMPLES / "ci_check_conversion.sh")
    # JQ= takes the Python path, whether jq is installed or not.
    good = run_example(
        ["bash", script, str(fsdp2_ckpt.dcp), str(fsdp2_ckpt.ref), "good"], tmp_path, JQ=""
    )
    assert good.returncode == 0, good.stdout + good.stderr
    assert "equal: 118 leaves compared" in good.stdout
    bad = run_example(
        ["bash", script, str(fsdp2_ckpt.dcp), str(tmp_path / "bad-ref.pt"), "bad"], tmp_path, JQ=""
    )
    assert bad.returncode == 1, bad.stdout + bad.stderr
    said, differences = bad.stderr.splitlines()[-2:]
    assert said == f"FAIL: the conversion differs from {tmp_path / 'bad-ref.pt'} at:"
    assert differences.startswith(
        '{"path":["model","blocks.1.fc_in.bias"],"reason":"values differ","max_abs_diff":0.000999'
    )
