"""Equality of leaves: tensors bit for bit or within tolerances, plain values by type and value (pure)."""

from __future__ import annotations

import math
import sys

from shardckpt.core.lazy_torch import is_tensor, torch
from shardckpt.core.libc import same_memory


def values_equal(x: object, y: object) -> bool:
    """Return whether two plain values are equal with the same types (NaN equals NaN)."""
    if type(x) is not type(y):
        return False
    if isinstance(x, float):
        return x == y or (math.isnan(x) and math.isnan(y))
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(values_equal(i, j) for i, j in zip(x, y))
    if isinstance(x, dict):
        return list(x) == list(y) and all(values_equal(x[k], y[k]) for k in x)
    if is_tensor(x):
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        return tensors_differ(x, y, 0.0, 0.0)[0] is False
    if _is_array(x):
        # ``==`` on arrays is elementwise, and its truth value raises (an RNG state
        # that a trusted pickle holds, numpy's ('MT19937', uint32 array, ...) tuple).
        numpy = sys.modules["numpy"]
        return _arrays_equal(numpy.asarray(x), numpy.asarray(y))
    return x == y


def _is_array(x: object) -> bool:
    """Return whether ``x`` is a numpy array or scalar, without importing numpy (none exists before it is)."""
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(x, (numpy.ndarray, numpy.generic))


def _arrays_equal(x, y) -> bool:
    """Return whether two numpy arrays have one dtype and shape and the same values, bit for bit."""
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    if x.dtype.hasobject:
        # The bytes of an object array are pointers: compare what they point to.
        return all(values_equal(i, j) for i, j in zip(x.ravel().tolist(), y.ravel().tolist()))
    return x.tobytes() == y.tobytes()


def tensors_differ(
    x: torch.Tensor, y: torch.Tensor, atol: float, rtol: float
) -> tuple[bool, float]:
    """Return whether two same-shape tensors differ (bitwise when atol = rtol = 0) and max |x-y|."""
    if x.numel() == 0:
        return False, 0.0
    if x.dtype == y.dtype and same_bytes(x, y):
        # The same bytes are equal under any tolerance: compared as bytes, no float64 copies
        # of either side (which made diff and --verify read at a fifth of the writer's pace).
        return False, 0.0
    wide = torch.complex128 if x.is_complex() else torch.float64
    xd, yd = x.to(wide), y.to(wide)
    delta = (xd - yd).abs()
    both_nan = torch.isnan(xd.real if xd.is_complex() else xd) & torch.isnan(
        yd.real if yd.is_complex() else yd
    )
    delta = torch.where(both_nan, torch.zeros_like(delta), delta)
    max_diff = float(torch.nan_to_num(delta, nan=math.inf).max()) if delta.numel() else 0.0
    if atol == 0.0 and rtol == 0.0:
        # Of one dtype, their bytes were found to differ above.
        same = x.dtype != y.dtype and same_bytes(x, y)
    else:
        same = bool(torch.isclose(xd, yd, rtol=rtol, atol=atol, equal_nan=True).all())
    return (not same), max_diff


def same_bytes(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Return whether two tensors of one shape and dtype hold the same bytes.

    Contiguous CPU tensors go through libc's ``memcmp`` (``core.libc.same_memory``);
    ``torch.equal`` compares element by element.
    """
    if x.device.type == y.device.type == "cpu" and x.is_contiguous() and y.is_contiguous():
        n = x.numel() * x.element_size()
        return n == y.numel() * y.element_size() and same_memory(x.data_ptr(), y.data_ptr(), n)
    return torch.equal(_bits(x), _bits(y))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)
