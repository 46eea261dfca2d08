"""DCP's ``.metadata`` classes as plain stand-ins, for reading it without torch.

``inspect`` and ``verify`` of a DCP checkpoint read only ``.metadata`` and the bytes of
the data files, so they do not import torch (``core/lazy_torch.py``): the restricted
unpickler (``reader._MetadataUnpickler``) then builds these classes where a process with
torch loaded builds torch's own. Each has the fields, pickled state and equality of
torch's class of the same name (``torch.distributed.checkpoint.metadata`` and
``filesystem._StorageInfo``); a ``MetadataIndex`` of either kind finds the other's
entry in a dict. ``is_a`` asks what an object is, whichever kind it is.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from dataclasses import dataclass, field, fields
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any

from shardckpt.state.dtypes import ALIASES, KNOWN

_METADATA = "torch.distributed.checkpoint.metadata"
_FILESYSTEM = "torch.distributed.checkpoint.filesystem"


class Size(tuple):
    """``torch.Size``: a tuple of ints (a pickle calls it with the tuple)."""

    __slots__ = ()


@dataclass
class ChunkStorageMetadata:
    offsets: Size
    sizes: Size


class MemoryFormat(int):
    """``_MEM_FORMAT_ENCODING``: torch's enum of memory formats, by its value."""

    __slots__ = ()


@dataclass
class TensorProperties:
    dtype: Any = None
    layout: Any = None
    requires_grad: bool = False
    memory_format: Any = None
    pin_memory: bool = False
    strides: Any = None
    """The saved tensor's strides (torch 2.15 and later pickle six fields, earlier five)."""

    def __getstate__(self) -> tuple:
        # As __setstate__ reads it: a reader's metadata goes to the other ranks pickled.
        return tuple(getattr(self, f.name) for f in fields(self))

    def __setstate__(self, state: tuple) -> None:
        if len(state) == 5:
            state = (*state, None)
        for f, value in zip(fields(self), state, strict=True):
            setattr(self, f.name, value)


@dataclass
class TensorStorageMetadata:
    properties: TensorProperties
    size: Size
    chunks: list[ChunkStorageMetadata]


@dataclass
class BytesStorageMetadata:
    pass


@dataclass
class StorageMeta:
    checkpoint_id: Any = None
    save_id: str | None = None
    load_id: str | None = None
    modules: list[str] = field(default_factory=list)


@dataclass
class Metadata:
    state_dict_metadata: dict
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: StorageMeta | None = None
    version: str | None = None


class MetadataIndex:
    """A stored item's key: its FQN and, for a tensor's chunk, the chunk's offsets."""

    __slots__ = ("fqn", "offset", "index")

    def __init__(self, fqn: str, offset: tuple | None = None, index: int | None = None):
        self.fqn = fqn
        self.offset = None if offset is None else Size(offset)
        self.index = index

    def __getstate__(self) -> dict:
        return {"fqn": self.fqn, "offset": self.offset, "index": self.index}

    def __setstate__(self, state: dict) -> None:
        # torch's is a frozen dataclass: the pickle holds its __dict__.
        self.fqn = state.get("fqn")
        self.offset = state.get("offset")
        self.index = state.get("index")

    def __hash__(self) -> int:
        return hash((self.fqn, self.offset))  # as torch's dataclass hashes

    def __eq__(self, other: object) -> bool:
        if not hasattr(other, "fqn") or not hasattr(other, "offset"):
            return NotImplemented
        return (self.fqn, self.offset) == (other.fqn, other.offset)  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return f"MetadataIndex(fqn={self.fqn!r}, offset={self.offset!r}, index={self.index!r})"


@dataclass
class StorageInfo:
    """``filesystem._StorageInfo``: where a stored item lies in its data file."""

    relative_path: str
    offset: int
    length: int
    transform_descriptors: Any = None


def _layout(name: str) -> str:
    """``torch.serialization._get_layout``: a layout by its name, kept as the name."""
    return name


CLASSES = (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    TensorProperties,
)
"""DCP's public metadata classes, each named as ``torch.distributed.checkpoint.metadata``'s."""

VOCABULARY: dict[tuple[str, str], object] = {
    **{(_METADATA, c.__name__): c for c in CLASSES},
    (_METADATA, "_MEM_FORMAT_ENCODING"): MemoryFormat,
    (_FILESYSTEM, "_StorageInfo"): StorageInfo,
    ("torch.serialization", "_get_layout"): _layout,
    ("torch", "Size"): Size,
    ("collections", "OrderedDict"): OrderedDict,
    **{("torch", name): dtype for name, dtype in KNOWN.items()},
    **{("torch", alias): KNOWN[name] for alias, name in ALIASES.items()},
    # StorageMeta.checkpoint_id may be the path it was saved to, read as a pure path
    # (as the reader's vocabulary for torch's classes does).
    **{
        (module, f"{prefix}{system}Path"): pure
        for module in ("pathlib", "pathlib._local")
        for system, pure in (("Posix", PurePosixPath), ("Windows", PureWindowsPath))
        for prefix in ("", "Pure")
    },
}
"""What a ``.metadata`` pickle names, as these stand-ins."""

_PLAIN = {
    cls.__name__: cls
    for cls in (
        Metadata,
        MetadataIndex,
        TensorStorageMetadata,
        BytesStorageMetadata,
        ChunkStorageMetadata,
    )
}


def is_a(value: object, name: str) -> bool:
    """Return whether ``value`` is DCP's metadata class ``name``: this module's, or torch's where loaded."""
    if isinstance(value, _PLAIN[name]):
        return True
    module = sys.modules.get(_METADATA)
    return module is not None and isinstance(value, getattr(module, name))
