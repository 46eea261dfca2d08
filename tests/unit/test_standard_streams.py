"""A missing or failing standard stream never changes an exit code (issue 30, item 15).

With stderr closed (``2>&-``) a valid conversion ended "internal error ('NoneType' ...
isatty)", exit 4, writing nothing, and printed that line on stdout; with ``2>/dev/full``
a missing SRC exited 1, not 3; with stdout closed ``inspect`` lost its output and
exited 0. Now stderr is a courtesy (its lines are lost, the outcome and its code stand),
and stdout carries what a command owes: closed, a command with output exits 4 before it
starts; failing as the output is printed, exit 4 with a line saying so on stderr. Each
case runs in a process of its own, started with the stream as a shell would leave it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import warm_cli

pytestmark = pytest.mark.launches

STDOUT_CLOSED = (
    "shardckpt: error: '<stdout>': is closed: run it with stdout open (not `>&-`), or with -q "
    "where it has one\n"
)
STDOUT_FULL = (
    "shardckpt: error: '<stdout>': the output could not be written (No space left on device)"
)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """Return a small ``torch.save`` checkpoint."""
    path = tmp_path_factory.mktemp("streams") / "src.pt"
    gen = torch.Generator().manual_seed(0)
    torch.save({"model": {"w": torch.randn(7, 3, generator=gen), "b": torch.arange(5)}}, path)
    return path


def closed(fd: int):
    return (warm_cli.close_stream, fd)


def full(fd: int):
    return (warm_cli.stream_to, fd, "/dev/full")


def shardckpt(argv: list, setup) -> subprocess.CompletedProcess:
    return warm_cli.run([str(a) for a in argv], setup=setup)


def leftovers(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".shardckpt-" in p.name)


def same_as(dst, src) -> bool:
    got, want = torch.load(dst, weights_only=True), torch.load(src, weights_only=True)
    return got.keys() == want.keys() and all(
        torch.equal(got["model"][k], v) for k, v in want["model"].items()
    )


@pytest.mark.parametrize("stderr", ["closed", "full"])
@pytest.mark.parametrize("json_out", [False, True])
def test_a_conversion_succeeds_whatever_became_of_stderr(src, tmp_path, stderr, json_out):
    dst = tmp_path / "out.pt"
    argv = ["convert", src, dst, "--to", "full", *(["--json"] if json_out else [])]
    done = shardckpt(argv, closed(2) if stderr == "closed" else full(2))
    assert done.returncode == 0, done.stderr
    if json_out:
        assert json.loads(done.stdout)["tensors"] == 2
    else:
        assert done.stdout.startswith(f"wrote {dst}: 2 tensors")
    assert same_as(dst, src)
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("stderr", ["closed", "full"])
def test_an_error_keeps_its_own_exit_code_whatever_became_of_stderr(src, tmp_path, stderr):
    setup = closed(2) if stderr == "closed" else full(2)
    missing = tmp_path / "missing.pt"
    taken = tmp_path / "taken.pt"
    taken.write_bytes(src.read_bytes())
    cases = [
        (["inspect", missing], 3),
        (["convert", missing, tmp_path / "out.pt", "--to", "full"], 3),
        (["convert", src, taken, "--to", "full"], 5),
        (["convert", src, tmp_path / "out.pt", "--to", "fulll"], 2),
        (["diff", src, tmp_path / "other.pt", "-q"], 1),
    ]
    torch.save({"model": {"w": torch.zeros(7, 3), "b": torch.arange(5)}}, tmp_path / "other.pt")
    for argv, code in cases:
        done = shardckpt(argv, setup)
        # The error line never moves to stdout, where a script reads the output.
        assert (done.returncode, done.stdout) == (code, ""), argv
    assert not (tmp_path / "out.pt").exists()
    assert taken.read_bytes() == src.read_bytes()
    assert leftovers(tmp_path) == []


def test_inspect_with_stderr_closed_prints_its_output(src):
    done = shardckpt(["inspect", src, "--json"], closed(2))
    assert done.returncode == 0
    assert json.loads(done.stdout)["totals"]["tensors"] == 2


@pytest.mark.parametrize(
    "argv",
    [["inspect"], ["inspect", "--json"], ["verify"], ["diff", "SRC"], ["diff", "SRC", "--json"]],
)
def test_a_command_whose_output_cannot_be_printed_exits_4_saying_so(src, argv):
    argv = [a if a != "SRC" else src for a in [argv[0], src, *argv[1:]]]
    for setup, line in ((closed(1), STDOUT_CLOSED), (full(1), STDOUT_FULL)):
        done = shardckpt(argv, setup)
        assert done.returncode == 4, (argv, done.stderr)
        assert done.stderr.startswith(line), done.stderr
        assert done.stderr.count("\n") == 1


def test_a_conversion_that_could_not_report_to_a_closed_stdout_writes_nothing(src, tmp_path):
    dst = tmp_path / "out.pt"
    for argv in (["--json"], [], ["--dry-run"]):
        done = shardckpt(["convert", src, dst, "--to", "full", *argv], closed(1))
        assert (done.returncode, done.stderr) == (4, STDOUT_CLOSED), argv
        assert not dst.exists()
        assert leftovers(tmp_path) == []
    # With nothing to print, a closed stdout is no matter.
    done = shardckpt(["convert", src, dst, "--to", "full", "-q"], closed(1))
    assert (done.returncode, done.stderr) == (0, "")
    assert same_as(dst, src)


def test_a_conversion_whose_summary_is_lost_says_dst_is_in_place(src, tmp_path):
    dst = tmp_path / "out.pt"
    done = shardckpt(["convert", src, dst, "--to", "full", "--json"], full(1))
    assert (done.returncode, done.stderr) == (
        4,
        f"{STDOUT_FULL}: the conversion finished and '{dst}' is in place: only what it "
        "printed is lost\n",
    )
    assert same_as(dst, src)
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize(
    ("shell", "code", "stdout"),
    [
        ("convert SRC DST --to full 2>&-", 0, "wrote "),
        ("inspect MISSING 2>/dev/full", 3, ""),
        ("inspect MISSING 2>&-", 3, ""),
        ("inspect SRC >&-", 4, None),
    ],
)
def test_the_issues_lines_from_a_shell(src, tmp_path, shell, code, stdout):
    line = shell.replace("SRC", str(src)).replace("DST", str(tmp_path / "out.pt"))
    line = line.replace("MISSING", str(tmp_path / "missing.pt"))
    done = subprocess.run(
        ["sh", "-c", f"exec '{sys.executable}' -m shardckpt {line}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == code, done.stderr
    if stdout is not None:
        assert done.stdout.startswith(stdout) if stdout else done.stdout == ""
    if "2>" not in shell:
        assert done.stderr == STDOUT_CLOSED
    assert (tmp_path / "out.pt").exists() == (code == 0)
    assert leftovers(tmp_path) == []
