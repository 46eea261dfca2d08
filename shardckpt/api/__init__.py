"""The library surface: ``inspect``, ``convert``, ``diff`` and ``verify``, each taking one request.

    from shardckpt import api

    result = api.convert(api.ConvertRequest(src="ckpt/step-100", dst="full.pt", to="full"))

Each function takes an optional ``runtime`` (``shardckpt.core.dist.launch``); without
one it runs standalone. Under several ranks every rank calls the same function with an
equal request; inputs are validated inside the first agreed step, so a bad input seen
by any rank stops all of them with one error. See docs/python-api.md.
"""

from __future__ import annotations

import importlib

# Each name from the module that holds it, imported when first read: ``inspect`` and
# ``verify`` load neither ``convert``'s nor ``diff``'s modules (and those import torch).
_HOME = {
    "LAYOUTS": "shardckpt.state.choices",
    "ConvertRequest": "shardckpt.api.requests",
    "ConvertResult": "shardckpt.api.conversion",
    "DiffReport": "shardckpt.api.comparison",
    "DiffRequest": "shardckpt.api.requests",
    "DiffResult": "shardckpt.engine.compare",
    "Finding": "shardckpt.api.integrity",
    "InspectRequest": "shardckpt.api.requests",
    "Inspection": "shardckpt.api.inspection",
    "Integrity": "shardckpt.api.integrity",
    "VerifyRequest": "shardckpt.api.requests",
    "convert": "shardckpt.api.conversion",
    "diff": "shardckpt.api.comparison",
    "inspect": "shardckpt.api.inspection",
    "verify": "shardckpt.api.integrity",
}


def __getattr__(name: str) -> object:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOME])


__all__ = [
    "LAYOUTS",
    "ConvertRequest",
    "ConvertResult",
    "DiffReport",
    "DiffRequest",
    "DiffResult",
    "Finding",
    "InspectRequest",
    "Inspection",
    "Integrity",
    "VerifyRequest",
    "convert",
    "diff",
    "inspect",
    "verify",
]
