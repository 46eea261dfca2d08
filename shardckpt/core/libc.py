"""The C library's calls Python has no function for, through ctypes (Linux only)."""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from typing import Any


def linux_call(name: str, argtypes: list[Any]) -> Callable[..., int] | None:
    """Return libc's ``name``, taking ``argtypes`` and returning an int; None off Linux or where libc has none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        call = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    call.argtypes = argtypes
    call.restype = ctypes.c_int
    return call
