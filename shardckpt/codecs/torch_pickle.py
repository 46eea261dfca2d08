"""A ``torch.save`` zip read without torch: its ``data.pkl`` into plain stand-ins, and its records.

``inspect`` and ``verify`` of a ``torch.save`` file need the tree of values, each
tensor's dtype, shape and view of its storage, and the zip record that holds each
storage: ``plain_torch_file`` gives them without importing torch. Its unpickler admits
a strict subset of what torch's ``weights_only`` unpickler admits (the same opcodes but
``SHORT_BINSTRING``, no ``NEWOBJ``, and the globals in ``_GLOBALS``), and builds a
``PlainTensor`` where torch would rebuild a tensor. Anything else (a global it does not
know, a zip or a view torch might read otherwise, another byte order) is ``NotPlain``:
the caller loads the file with torch, which says what it always said about it.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import sys
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path

from shardckpt.codecs.pickle_scan import DamagedZip
from shardckpt.codecs.zip_records import ZipRecord, zip_records
from shardckpt.core.files import open_source, pread
from shardckpt.state.dtypes import KNOWN, Dtype
from shardckpt.state.plain_tensor import PlainTensor


class NotPlain(Exception):
    """A file (or a part of it) this module does not read: torch's loader reads it instead."""


@dataclass(frozen=True)
class PlainFile:
    """What a ``torch.save`` zip holds: its object with ``PlainTensor`` leaves, its storage records by key."""

    obj: object
    records: dict[str, ZipRecord]


@dataclass(frozen=True)
class _StorageType:
    """``torch.FloatStorage`` and its kind (``dtype``), or ``torch.storage.UntypedStorage`` (None)."""

    dtype: Dtype | None


@dataclass(frozen=True)
class _Storage:
    """A storage the pickle names by persistent id: its record's key, dtype and bytes."""

    key: str
    dtype: Dtype | None
    nbytes: int


# torch.storage._dtype_to_storage_type_map, but the quantized ones.
_STORAGES = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "BFloat16Storage": "bfloat16",
    "ComplexDoubleStorage": "complex128",
    "ComplexFloatStorage": "complex64",
}

_OPCODES = {
    op.code.encode("latin-1")[0]
    for op in pickletools.opcodes
    if op.name
    in {
        "GLOBAL", "REDUCE", "BUILD", "APPEND", "APPENDS", "SETITEM", "SETITEMS", "MARK",
        "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "NONE", "NEWFALSE", "NEWTRUE", "EMPTY_TUPLE",
        "EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET", "BININT", "BININT1", "BININT2", "BINFLOAT",
        "BINUNICODE", "BINPERSID", "BINGET", "LONG_BINGET", "BINPUT", "LONG_BINPUT", "LONG1",
        "PROTO", "STOP",
    }
}  # fmt: skip
"""The opcodes torch's ``weights_only`` unpickler reads, but ``SHORT_BINSTRING`` (decoded otherwise)."""


def _is_int(value: object) -> bool:
    return type(value) is int


def _ints(value: object) -> bool:
    return type(value) is tuple and all(_is_int(v) and v >= 0 for v in value)


def _no_hooks(hooks: object) -> bool:
    return type(hooks) is OrderedDict and not hooks


def _view(
    storage: object, dtype: object, offset, size, stride, requires_grad, hooks
) -> PlainTensor:
    """Return the tensor torch's ``set_`` makes of ``storage``; ``NotPlain`` where torch might refuse it."""
    if not (
        isinstance(storage, _Storage)
        and isinstance(dtype, Dtype)
        and _is_int(offset)
        and offset >= 0
        and _ints(size)
        and _ints(stride)
        and len(size) == len(stride)
        and type(requires_grad) is bool
        and _no_hooks(hooks)
    ):
        raise NotPlain("a tensor rebuilt from arguments torch.save does not write")
    if all(size):
        extent = 1 + sum((s - 1) * st for s, st in zip(size, stride))
        if (offset + extent) * dtype.itemsize > storage.nbytes:
            raise NotPlain("a view outside its storage")
    return PlainTensor(dtype, size, stride, offset, storage.key, storage.nbytes)


def _rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks, *metadata):
    """``torch._utils._rebuild_tensor_v2`` over a typed storage (``FloatStorage``)."""
    if metadata not in ((), (None,)) or not isinstance(storage, _Storage) or storage.dtype is None:
        raise NotPlain("a tensor with metadata, or over an untyped storage")
    return _view(storage, storage.dtype, offset, size, stride, requires_grad, hooks)


def _rebuild_tensor_v3(storage, offset, size, stride, requires_grad, hooks, dtype, *metadata):
    """``torch._utils._rebuild_tensor_v3``: an ``UntypedStorage`` and the tensor's dtype."""
    if metadata not in ((), (None,)) or not isinstance(storage, _Storage) or storage.dtype:
        raise NotPlain("a tensor with metadata, or over a typed storage")
    return _view(storage, dtype, offset, size, stride, requires_grad, hooks)


def _rebuild_parameter(data, requires_grad, hooks):
    """``torch._utils._rebuild_parameter``: an ``nn.Parameter`` of ``data``."""
    if not isinstance(data, PlainTensor) or type(requires_grad) is not bool or not _no_hooks(hooks):
        raise NotPlain("a parameter rebuilt from arguments torch.save does not write")
    return replace(data)


def _ordered_dict(*args):
    if args:
        raise NotPlain("an OrderedDict built from arguments")
    return OrderedDict()


_GLOBALS: dict[tuple[str, str], object] = {
    ("collections", "OrderedDict"): _ordered_dict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch.storage", "UntypedStorage"): _StorageType(None),
    **{("torch", cls): _StorageType(KNOWN[name]) for cls, name in _STORAGES.items()},
    **{("torch", name): dtype for name, dtype in KNOWN.items()},
}
"""What the pickle may name: each on torch's ``weights_only`` allow-list."""
_CALLS = {
    id(f) for f in (_ordered_dict, _rebuild_tensor_v2, _rebuild_tensor_v3, _rebuild_parameter)
}


class _Unpickler(pickle._Unpickler):  # type: ignore[name-defined]
    """Python's own unpickler, reading only ``_OPCODES`` and checking targets as torch's does."""

    def __init__(self, data: bytes, records: dict[str, ZipRecord]):
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self._records = records
        self._storages: dict[str, _Storage] = {}
        base = pickle._Unpickler.dispatch  # type: ignore[attr-defined]
        self.dispatch = {op: base[op] for op in _OPCODES}
        for op, check in (
            (pickle.APPEND, lambda: self._below(1) if type(self._below(1)) is list else None),
            (pickle.APPENDS, lambda: self._marked() if type(self._marked()) is list else None),
            (pickle.SETITEM, lambda: self._below(2) if type(self._below(2)) in _DICTS else None),
            (pickle.SETITEMS, lambda: self._marked() if type(self._marked()) in _DICTS else None),
            (pickle.REDUCE, lambda: id(self._below(1)) in _CALLS or None),
        ):
            self.dispatch[op[0]] = self._guarded(base[op[0]], check, op)
        self.dispatch[pickle.BUILD[0]] = _Unpickler._build

    def _below(self, n: int) -> object:
        """Return the object ``n`` places below the top of the stack (None where there is none)."""
        return self.stack[-1 - n] if len(self.stack) > n else None

    def _marked(self) -> object:
        """Return the object below the last mark: what APPENDS and SETITEMS add to."""
        return self.metastack[-1][-1] if self.metastack and self.metastack[-1] else None

    def _guarded(self, load, check, op: bytes):
        def guarded(unpickler) -> None:
            if check() is None:
                raise NotPlain(f"opcode {op!r} on what torch's loader refuses it on")
            load(unpickler)

        return guarded

    def _build(self) -> None:
        """BUILD, on an ``OrderedDict`` only (a module's ``state_dict()`` and its ``_metadata``)."""
        state = self.stack.pop()
        if type(self._below(0)) is not OrderedDict or type(state) is not dict:
            raise NotPlain("a state set on what is not an OrderedDict")
        self.stack[-1].__dict__.update(state)

    def find_class(self, module: str, name: str):
        found = _GLOBALS.get((module, name))
        if found is None:
            raise NotPlain(f"{module}.{name}")
        return found

    def persistent_load(self, pid):
        if not (type(pid) is tuple and len(pid) == 5 and pid[0] == "storage"):
            raise NotPlain("a persistent id that is not a storage")
        _, kind, key, location, numel = pid
        if not (isinstance(kind, _StorageType) and type(key) is str and type(location) is str):
            raise NotPlain("a storage named otherwise than torch.save names one")
        if not _is_int(numel) or numel < 0:
            raise NotPlain("a storage of no size")
        nbytes = numel * (kind.dtype.itemsize if kind.dtype else 1)
        storage = _Storage(key, kind.dtype, nbytes)
        known = self._storages.setdefault(key, storage)
        record = self._records.get(key)
        if known != storage or record is None or record.length != nbytes:
            raise NotPlain(f"storage {key!r} does not match its record")
        return storage


_DICTS = (dict, OrderedDict)


def stand_ins(value: object) -> bool:
    """Return whether ``value`` holds a stand-in of this module anywhere (keys, tuples and sets too)."""
    if isinstance(value, (PlainTensor, Dtype, _Storage, _StorageType)) or id(value) in _CALLS:
        return True
    if isinstance(value, dict):
        return any(stand_ins(k) or stand_ins(v) for k, v in value.items())
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(stand_ins(v) for v in value)
    return False


def plain_torch_file(path: Path) -> PlainFile:
    """Return what the ``torch.save`` zip ``path`` holds, as ``torch.load(weights_only=True)`` would read it.

    ``path`` has passed ``check_torch_file``. Raises ``NotPlain`` for any file not laid out
    as ``torch.save`` lays one out (one archive, its ``version`` 3, this machine's byte
    order, a record of each storage's size) or whose pickle needs more than the stand-ins.
    """
    fd = open_source(path)
    try:
        try:
            records = zip_records(fd, 0, os.fstat(fd).st_size, central=False)
        except DamagedZip as exc:
            raise NotPlain(str(exc)) from None
        if not records or not records[0].name.endswith("/data.pkl"):
            raise NotPlain("a zip whose first record is not data.pkl")
        archive = records[0].name[: -len("/data.pkl")]
        named = {r.name: r for r in records}
        if (
            not archive
            or "/" in archive
            # torch's zip reader finds a record by its name in any case: each must be one.
            or len({r.name.lower() for r in records}) != len(records)
            or any(not r.name.startswith(f"{archive}/") for r in records)
            or sum(r.name.lower().endswith("data.pkl") for r in records) != 1
        ):
            raise NotPlain("a zip torch.save does not write")
        for name, wanted in (("version", b"3\n"), ("byteorder", sys.byteorder.encode())):
            record = named.get(f"{archive}/{name}")
            if record is None or pread(fd, record.length, record.start) != wanted:
                raise NotPlain(f"no {name} record, or another {name}")
        pickled = pread(fd, records[0].length, records[0].start)
    finally:
        os.close(fd)
    prefix = f"{archive}/data/"
    storages = {r.name[len(prefix) :]: r for r in records if r.name.startswith(prefix)}
    return PlainFile(plain_pickle(pickled, storages), storages)


def plain_pickle(pickled: bytes, storages: dict[str, ZipRecord]) -> object:
    """Return what a ``torch.save`` zip's ``data.pkl`` (``pickled``) holds, with ``PlainTensor`` leaves.

    ``storages``: the zip's storage records by key (``<archive>/data/KEY``). Raises
    ``NotPlain`` where the pickle needs more than the stand-ins (torch's loader reads it).
    """
    unpickler = _Unpickler(pickled, storages)
    try:
        return unpickler.load()
    except NotPlain:
        raise
    except Exception as exc:  # noqa: BLE001 - torch's loader reads it again and words the error
        raise NotPlain(str(exc)) from None
