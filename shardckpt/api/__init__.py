"""The library surface: ``inspect``, ``convert``, ``diff`` and ``verify``, each taking one request.

    from shardckpt import api

    result = api.convert(api.ConvertRequest(src="ckpt/step-100", dst="full.pt", to="full"))

Each function takes an optional ``runtime`` (``shardckpt.core.dist.launch``); without
one it runs standalone. Under several ranks every rank calls the same function with an
equal request; inputs are validated inside the first agreed step, so a bad input seen
by any rank stops all of them with one error. See docs/python-api.md.
"""

from __future__ import annotations

from shardckpt.api.comparison import DiffReport, diff
from shardckpt.api.conversion import ConvertResult, convert
from shardckpt.api.inspection import Inspection, inspect
from shardckpt.api.integrity import Finding, Integrity, verify
from shardckpt.api.requests import ConvertRequest, DiffRequest, InspectRequest, VerifyRequest
from shardckpt.engine.compare import DiffResult
from shardckpt.state.choices import LAYOUTS

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
