"""Session fixtures shared by every test tier."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# Spawned ranks unpickle their functions by module name (``reference._load_on_rank``),
# so tests/ must be importable whatever pytest's import mode; children inherit sys.path.
_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

from reference import Fsdp2Checkpoint, make_fsdp2_dcp  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    """Register the markers this suite uses."""
    # In the normal suite (scripts/test.sh, CI); `-m "not slow"` leaves them out locally.
    config.addinivalue_line(
        "markers", "slow: takes tens of seconds (runs examples or README lines end to end)"
    )


@pytest.fixture(scope="session")
def fsdp2_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Fsdp2Checkpoint:
    """Return a DCP checkpoint saved by FSDP2 at world size 4 and its full reference."""
    root = tmp_path_factory.mktemp("fsdp2_ckpt")
    return make_fsdp2_dcp(root / "dcp", root / "ref.pt", world_size=4, steps=2)


@pytest.fixture(scope="session")
def demo_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Return the demo's checkpoint as ``bash scripts/demo.sh`` makes it: FSDP2, 2 ranks, 3 steps."""
    root = tmp_path_factory.mktemp("demo")
    make_fsdp2_dcp(root / "ckpt-dcp", root / "ref.pt", world_size=2, steps=3)
    return root / "ckpt-dcp"
