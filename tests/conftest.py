"""Session fixtures shared by every test tier, and the quick tier's marking."""

from __future__ import annotations

import multiprocessing.process
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from filelock import FileLock

# Spawned ranks unpickle their functions by module name (``reference._load_on_rank``),
# so tests/ must be importable whatever pytest's import mode; children inherit sys.path.
_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

from reference import Fsdp2Checkpoint, make_fsdp2_dcp  # noqa: E402

# A suite started in the background of a script (`bash scripts/test.sh &`, a CI step's
# `cmd &`) inherits SIGINT ignored, as the shell does for every background job, and one
# started under `nohup` inherits SIGHUP ignored; the tests of Ctrl-C and of a closed
# terminal (in this process and in the processes it starts) need a terminal's defaults.
# shardckpt itself keeps an ignored signal ignored, as `nohup` users expect.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)

TESTS = Path(_TESTS_DIR)
# The quick tier is tests/unit less what starts a process; tests/dist (gloo ranks) and
# tests/e2e (torchrun, the CLI as a process) never are.
QUICK_DIR = TESTS / "unit"
# Session fixtures that run gloo ranks: a test using one is not quick, whether or not an
# earlier test of the session already made it.
LAUNCHING_FIXTURES = frozenset({"fsdp2_ckpt", "demo_ckpt"})


def pytest_configure(config: pytest.Config) -> None:
    """Register the markers this suite uses."""
    # In the normal suite (scripts/test.sh, CI); `-m "not slow"` leaves them out locally.
    config.addinivalue_line(
        "markers", "slow: takes tens of seconds (runs examples or README lines end to end)"
    )
    config.addinivalue_line(
        "markers",
        "launches: starts a process (a subprocess, a mount, torchrun, gloo ranks): never quick",
    )
    config.addinivalue_line(
        "markers",
        "quick: set by tests/conftest.py on every test of tests/unit that starts no process "
        "(no `launches` marker, no fixture that runs ranks); `bash scripts/test.sh -m quick`",
    )


def _quick_only(config: pytest.Config) -> bool:
    """Return whether ``-m`` asks for quick tests alone (``quick``, ``quick and ...``)."""
    expr = " ".join((config.option.markexpr or "").split())
    return expr == "quick" or expr.startswith("quick and ")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Skip importing tests/dist and tests/e2e (lightning, transformers...) for ``-m quick``."""
    if _quick_only(config) and collection_path in (TESTS / "dist", TESTS / "e2e"):
        return True
    return None


def _is_quick(item: pytest.Item) -> bool:
    """Return whether ``item`` runs in this process alone (see the ``quick`` marker)."""
    return (
        item.path.is_relative_to(QUICK_DIR)
        and item.get_closest_marker("launches") is None
        and item.get_closest_marker("slow") is None
        and not LAUNCHING_FIXTURES.intersection(getattr(item, "fixturenames", ()))
    )


# The tiers from slowest file to fastest: tests/e2e's files take 30-90 s each, tests/unit's
# a few seconds at most.
TIER_ORDER = (TESTS / "e2e", TESTS / "dist", TESTS / "unit")


def _tier(item: pytest.Item) -> int:
    """Return the position of ``item``'s tier in ``TIER_ORDER`` (after them all if none)."""
    return next(
        (i for i, tier in enumerate(TIER_ORDER) if item.path.is_relative_to(tier)),
        len(TIER_ORDER),
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every quick test ``quick``; under pytest-xdist, put the slowest tiers first."""
    for item in items:
        if _is_quick(item):
            item.add_marker(pytest.mark.quick)
    if os.environ.get("PYTEST_XDIST_WORKER") is not None:
        # Workers are handed whole files in this order (scripts/test.sh passes
        # --no-loadscope-reorder): long files first and short ones last let two workers
        # finish together, where a 90 s file handed out last keeps one busy alone.
        items.sort(key=_tier)


class StartedAProcess(AssertionError):
    """A test marked quick started a process: it needs the ``launches`` marker."""


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise StartedAProcess(
            f"a quick test started a process ({what}): mark the test "
            "@pytest.mark.launches (tests/conftest.py says why)"
        )

    return refuse


@contextmanager
def _no_process(item: pytest.Item) -> Iterator[None]:
    """Make starting a process raise while a quick test (or a fixture it sets up) runs."""
    if item.get_closest_marker("quick") is None:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "_execute_child", _refuse("subprocess"))
        patch.setattr(multiprocessing.process.BaseProcess, "start", _refuse("multiprocessing"))
        # Not os.system: the pickles of tests/unit/test_malicious.py run it to show that
        # --trust-pickle runs their code, a shell that only touches a file.
        for name in ("fork", "posix_spawn"):
            patch.setattr(os, name, _refuse(f"os.{name}"))
        yield


# Setup too: a module or session fixture is made while the first test that uses it sets up.
@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    with _no_process(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    with _no_process(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    with _no_process(item):
        return (yield)


def made_once(tmp_path_factory: pytest.TempPathFactory, name: str, make) -> Path:
    """Return directory ``name`` after ``make(it)`` filled it, once per run of the suite.

    Under pytest-xdist each worker is a session of its own: the first to get here makes
    the directory beside every worker's temporary root, the others wait for it and
    reuse it, so a session fixture is made once, not once per worker.
    """
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        root = tmp_path_factory.mktemp(name)
        make(root)
        return root
    root = tmp_path_factory.getbasetemp().parent / name
    with FileLock(f"{root}.lock"):
        if not (root / ".made").exists():
            shutil.rmtree(root, ignore_errors=True)  # a worker that died halfway
            root.mkdir()
            make(root)
            (root / ".made").touch()
    return root


@pytest.fixture(scope="session")
def fsdp2_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Fsdp2Checkpoint:
    """Return a DCP checkpoint saved by FSDP2 at world size 4 and its full reference."""

    def make(root: Path) -> None:
        make_fsdp2_dcp(root / "dcp", root / "ref.pt", world_size=4, steps=2)

    root = made_once(tmp_path_factory, "fsdp2_ckpt", make)
    return Fsdp2Checkpoint(root / "dcp", root / "ref.pt", 4)


@pytest.fixture(scope="session")
def demo_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Return the demo's checkpoint as ``bash scripts/demo.sh`` makes it: FSDP2, 2 ranks, 3 steps."""

    def make(root: Path) -> None:
        make_fsdp2_dcp(root / "ckpt-dcp", root / "ref.pt", world_size=2, steps=3)

    return made_once(tmp_path_factory, "demo", make) / "ckpt-dcp"
