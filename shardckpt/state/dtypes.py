"""A tensor's dtype known by name, for the commands that read metadata without torch.

``TensorMeta.dtype`` is a ``torch.dtype`` wherever torch is loaded. ``inspect`` and
``verify`` read metadata without importing torch (``core/lazy_torch.py``), and there a
reader names a dtype with ``Dtype``: what the metadata says of it (its name, its size,
whether it is floating) and nothing that needs tensors; it prints as torch's does
(``torch.float32``). ``dtype_named`` picks the one that fits the process.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from shardckpt.core.lazy_torch import loaded, torch


@dataclass(frozen=True)
class Dtype:
    """A dtype by torch's name for it: ``float32``, ``bfloat16``, ``int64``."""

    name: str
    itemsize: int
    kind: str = "-"
    """``f`` floating point, ``c`` complex, ``-`` other (integers, bool)."""

    @property
    def is_floating_point(self) -> bool:
        """Return whether the dtype is a floating-point one, as torch's says."""
        return self.kind == "f"

    @property
    def is_complex(self) -> bool:
        """Return whether the dtype is a complex one, as torch's says."""
        return self.kind == "c"

    def to_torch(self):
        """Return torch's dtype of this name (imports torch)."""
        return getattr(torch, self.name)

    def __str__(self) -> str:
        return f"torch.{self.name}"

    __repr__ = __str__


def _table(*rows: tuple[str, int, str]) -> dict[str, Dtype]:
    return {name: Dtype(name, size, kind) for name, size, kind in rows}


# torch's canonical names, as a pickle (DCP's .metadata) and str(dtype) spell them; the
# rest (quantized, bit-packed, sub-byte integers) are taken from torch itself.
KNOWN = _table(
    ("float64", 8, "f"),
    ("float32", 4, "f"),
    ("float16", 2, "f"),
    ("bfloat16", 2, "f"),
    ("float8_e4m3fn", 1, "f"),
    ("float8_e4m3fnuz", 1, "f"),
    ("float8_e5m2", 1, "f"),
    ("float8_e5m2fnuz", 1, "f"),
    ("float8_e8m0fnu", 1, "f"),
    ("complex128", 16, "c"),
    ("complex64", 8, "c"),
    ("complex32", 4, "c"),
    ("int64", 8, "-"),
    ("int32", 4, "-"),
    ("int16", 2, "-"),
    ("int8", 1, "-"),
    ("uint64", 8, "-"),
    ("uint32", 4, "-"),
    ("uint16", 2, "-"),
    ("uint8", 1, "-"),
    ("bool", 1, "-"),
)
ALIASES = {
    "double": "float64",
    "float": "float32",
    "half": "float16",
    "cdouble": "complex128",
    "cfloat": "complex64",
    "chalf": "complex32",
    "long": "int64",
    "int": "int32",
    "short": "int16",
}


def dtype_named(name: str):
    """Return the dtype torch calls ``name``: torch's own where torch is loaded, else a ``Dtype``.

    A name outside ``KNOWN`` (and its aliases) is looked up in torch, imported for it;
    one torch lacks raises ``AttributeError``.
    """
    if loaded():
        return getattr(torch, name)
    known = KNOWN.get(ALIASES.get(name, name))
    return known if known is not None else getattr(torch, name)


def of_process(dtype):
    """Return ``dtype`` as this process names dtypes: torch's where torch is loaded, else as it is.

    A reader that read metadata into stand-ins (DCP's ``.metadata``, without importing
    DCP's classes) hands torch's dtypes to a process that has torch, as every writer expects.
    """
    return dtype.to_torch() if isinstance(dtype, Dtype) and loaded() else dtype


def as_torch(dtype):
    """Return ``dtype`` as a ``torch.dtype`` (a ``Dtype`` is looked up in torch)."""
    return dtype.to_torch() if isinstance(dtype, Dtype) else dtype


def is_dtype(value: object) -> bool:
    """Return whether ``value`` is a dtype: a ``Dtype``, or torch's where torch is loaded."""
    module = sys.modules.get("torch")
    return isinstance(value, Dtype) or (module is not None and isinstance(value, module.dtype))
