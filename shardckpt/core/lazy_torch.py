"""torch, imported where first used: ``inspect``, ``verify`` and ``diff`` of equal bytes never load it.

Importing torch takes a second or more (8 s on a CUDA build), most of what reading a
checkpoint's metadata would cost. A module on those commands' paths that also makes or
reads tensors names torch through ``torch`` here, which imports it on the first attribute
read; ``is_tensor`` answers without importing it (no tensor exists before torch does).
A command that needs tensors imports torch itself, at its start (``cli/library.py``).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from shardckpt.core.signals import deferred


class LazyModule:
    """A module imported on the first read of one of its attributes."""

    __slots__ = ("_name",)

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attribute: str) -> Any:
        module = sys.modules.get(self._name)
        if module is None:
            # As cli/library.load imports it: a signal inside torch's import would abort
            # the process, so it is recorded and raised after.
            with deferred():
                module = importlib.import_module(self._name)
        return getattr(module, attribute)

    def __repr__(self) -> str:
        return f"LazyModule({self._name!r})"


torch: Any = LazyModule("torch")
"""torch, imported when one of its names is first read."""


def load() -> None:
    """Import torch now (signals held meanwhile, as on a first use)."""
    torch.Tensor  # noqa: B018 - the attribute's read imports it


def loaded() -> bool:
    """Return whether torch is imported in this process."""
    return "torch" in sys.modules


def is_tensor(value: object) -> bool:
    """Return whether ``value`` is a ``torch.Tensor``, without importing torch."""
    module = sys.modules.get("torch")
    return module is not None and isinstance(value, module.Tensor)
