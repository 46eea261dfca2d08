"""Malicious pickles in every format that unpickles, through every command: the payload never runs.

Each payload (``tests/pickle_payloads.py``) creates a marker file if anything runs it.
Without ``--trust-pickle`` every command refuses the file with exit 3 and one line that
names it and the option, and no marker appears, whether the format is detected or
named. With ``--trust-pickle`` the same files create the marker: the payloads are live,
so it is the refusal that kept them from running.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pickle_payloads as payloads
import pytest

from shardckpt.cli.app import run

HINT = ": pass --trust-pickle only if you trust this file"


COMMANDS = {
    "inspect": lambda src, out, fmt: ["inspect", src] + (["--from", fmt] if fmt else []),
    "convert": lambda src, out, fmt: (
        ["convert", src, out, "--to", "full"] + (["--from", fmt] if fmt else [])
    ),
    "diff": lambda src, out, fmt: (
        ["diff", src, src] + (["--from-a", fmt, "--from-b", fmt] if fmt else [])
    ),
}


@dataclass(frozen=True)
class Evil:
    """A checkpoint carrying a payload, and the marker the payload would create."""

    src: Path
    marker: Path
    refused: Path


def make_evil(root: Path, carrier: str, payload: str) -> Evil:
    """Write ``payload`` hidden in ``carrier`` under ``root``; return where it and its marker are."""
    root.mkdir(parents=True)
    marker = root / "PAYLOAD-RAN"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dcp.save's own, while building: not under test
        src = payloads.CARRIERS[carrier].build(root, payloads.PAYLOADS[payload](marker))
    return Evil(src, marker, payloads.CARRIERS[carrier].refused(src))


@pytest.fixture(scope="module")
def evil(tmp_path_factory) -> Callable[[str, str], Evil]:
    """Return a maker of one checkpoint per (carrier, payload), shared by the commands run on it."""
    root = tmp_path_factory.mktemp("evil")
    made: dict[tuple[str, str], Evil] = {}

    def get(carrier: str, payload: str) -> Evil:
        if (carrier, payload) not in made:
            made[(carrier, payload)] = make_evil(root / f"{carrier}-{payload}", carrier, payload)
        return made[(carrier, payload)]

    return get


def run_cli(capsys, argv) -> tuple[int, list[str]]:
    code = run([str(a) for a in argv])
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("named", [False, True], ids=["detected", "named"])
@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("payload", payloads.PAYLOADS)
@pytest.mark.parametrize("carrier", payloads.CARRIERS)
def test_a_malicious_pickle_is_refused_and_never_runs(
    capsys, recwarn, evil, tmp_path, carrier, payload, command, named
):
    bad = evil(carrier, payload)
    out = tmp_path / "out.pt"
    argv = COMMANDS[command](bad.src, out, payloads.CARRIERS[carrier].fmt if named else None)
    code, err = run_cli(capsys, argv)
    assert not bad.marker.exists(), "the payload ran"
    assert code == 3 and len(err) == 1, err
    assert err[0].startswith(f"shardckpt: error: '{bad.refused}': ") and err[0].endswith(HINT)
    assert not out.exists()
    assert [str(w.message) for w in recwarn] == []


@pytest.mark.parametrize("payload", payloads.PAYLOADS)
@pytest.mark.parametrize("carrier", payloads.CARRIERS)
def test_the_same_payload_runs_with_trust_pickle(capsys, tmp_path, carrier, payload):
    bad = make_evil(tmp_path / "evil", carrier, payload)
    run_cli(capsys, ["inspect", bad.src, "--trust-pickle"])
    assert bad.marker.exists()
