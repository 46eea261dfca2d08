"""A pickle written byte for byte as CPython's C pickler writes it, streamed to a file.

``pickle.dump`` keeps every object it has written alive in its memo until the end, so a
DCP ``.metadata`` of a million chunks (1,024 target ranks x 2,000 tensors) costs about
3 GB of memory to write. ``dump`` writes the same bytes, protocol 4 or 5, framing and
memo numbers included, from an object graph whose big containers are given lazily
(``LazyList``, ``LazyDict``): each item is made when it is written and dropped after.
Inside a lazy item, containers, ``torch.Size`` and plain instances are "transient":
they get memo numbers as the C pickler gives them, but only for as long as the item is
written, which is right for objects no other part of the graph refers to. Strings,
classes and the objects they reduce to (a dtype, an enum member) are kept, as the C
pickler keeps them: a later use of one is a memo reference.

The C pickler's rules followed here (``Modules/_pickle.c``): a frame boundary is checked
at the start of every object saved, and a frame of 64 KiB or more is closed there; a
string or bytes of 64 KiB or more is written outside frames; dicts and lists are written
in batches of 1,000 (a dict of exactly 1,000 items ends with an empty batch, a list
does not; one item is written alone); tuples of up to three items use ``TUPLE1..3``;
a reduction whose callable is ``copyreg.__newobj__`` is ``NEWOBJ``. What this module
does not know how to write raises ``NotStreamable``: the caller then pickles a
materialised copy with ``pickle.dump``. ``tests/unit/test_pickle_stream.py`` holds it to
``pickle.dumps`` byte for byte.
"""

from __future__ import annotations

import copyreg
import struct
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

_FRAME_TARGET = 64 * 1024
_FRAME_HEADER = 9
_FRAME_MIN = 4
_BATCH = 1000

_MARK, _STOP, _NONE = b"(", b".", b"N"
_BININT, _BININT1, _BININT2, _LONG1 = b"J", b"K", b"M", b"\x8a"
_BINFLOAT = b"G"
_NEWTRUE, _NEWFALSE = b"\x88", b"\x89"
_EMPTY_TUPLE, _TUPLE, _TUPLES = b")", b"t", (b"", b"\x85", b"\x86", b"\x87")
_EMPTY_LIST, _APPEND, _APPENDS = b"]", b"a", b"e"
_EMPTY_DICT, _SETITEM, _SETITEMS = b"}", b"s", b"u"
_SHORT_BINUNICODE, _BINUNICODE, _BINUNICODE8 = b"\x8c", b"X", b"\x8d"
_SHORT_BINBYTES, _BINBYTES, _BINBYTES8 = b"C", b"B", b"\x8e"
_BINGET, _LONG_BINGET, _MEMOIZE = b"h", b"j", b"\x94"
_STACK_GLOBAL, _REDUCE, _NEWOBJ, _BUILD, _FRAME = b"\x93", b"R", b"\x81", b"b", b"\x95"


_UNICODE_OPS = (_SHORT_BINUNICODE, _BINUNICODE, _BINUNICODE8)
_BYTES_OPS = (_SHORT_BINBYTES, _BINBYTES, _BINBYTES8)


def _sized(opcodes: tuple[bytes, bytes, bytes], size: int) -> bytes:
    """Return the opcode and length pickle writes before ``size`` bytes: a 1-, 4- or 8-byte length."""
    short, four, eight = opcodes
    if size < 256:
        return short + bytes([size])
    if size <= 0xFFFFFFFF:
        return four + struct.pack("<I", size)
    return eight + struct.pack("<Q", size)


class NotStreamable(Exception):
    """The graph holds an object this module does not write as the C pickler would."""


@dataclass(frozen=True, eq=False)
class Template:
    """Plain instances of ``cls`` given by their field values, written without being built.

    Such an instance pickles as ``NEWOBJ`` of its class with its ``__dict__`` as state
    (``copyreg.__newobj__``); ``fields`` are the ``__dict__``'s keys in order, and a field
    in ``sizes`` is a ``torch.Size`` given as a tuple of ints. ``make(*values)`` builds the
    real instance: the first one is pickled as it is, which also checks that it does
    pickle that way (else ``NotStreamable``).
    """

    cls: type
    fields: tuple[str, ...]
    make: Callable[..., Any]
    sizes: frozenset[str] = frozenset()


class Filled(tuple):
    """An instance of a ``Template`` by its field values: ``Filled((template, values))``."""

    __slots__ = ()


def filled(template: Template, *values: Any) -> Filled:
    """Return the instance of ``template`` with ``values``, to be written as if it were built."""
    return Filled((template, values))


@dataclass(frozen=True)
class LazyList:
    """A list of ``length`` items, written as a ``list``, made by ``items()`` while it is written."""

    length: int
    items: Callable[[], Iterator[Any]]

    def materialized(self) -> list:
        """Return the list itself."""
        return list(self.items())


@dataclass(frozen=True)
class LazyDict:
    """A dict of ``length`` items, written as a ``dict``, made by ``items()`` (key, value pairs)."""

    length: int
    items: Callable[[], Iterator[tuple[Any, Any]]]

    def materialized(self) -> dict:
        """Return the dict itself."""
        return dict(self.items())


def dump(obj: Any, file: BinaryIO, protocol: int | None = None) -> None:
    """Write ``pickle.dump(obj, file, protocol)``'s bytes, with ``LazyList``/``LazyDict`` as lists and dicts."""
    protocol = 4 if protocol is None else protocol
    if protocol not in (4, 5):
        raise NotStreamable(f"protocol {protocol}")
    _Writer(file, protocol).dump(obj)


def materialized(obj: Any) -> Any:
    """Return ``obj`` with every lazy container in it made a list or dict (for ``pickle.dump``)."""
    if isinstance(obj, (LazyList, LazyDict)):
        return materialized(obj.materialized())
    if type(obj) is Filled:
        template, values = obj
        return template.make(*values)
    if type(obj) is tuple:
        return tuple(materialized(v) for v in obj)
    if type(obj) is dict:
        return {materialized(k): materialized(v) for k, v in obj.items()}
    if type(obj) is list:
        return [materialized(v) for v in obj]
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        for name, value in vars(obj).items():
            if isinstance(value, (LazyList, LazyDict, dict, list)):
                object.__setattr__(obj, name, materialized(value))
    return obj


def _encode_long(value: int) -> bytes:
    """Return ``value`` as LONG1 stores it: little-endian two's complement, fewest bytes."""
    if value == 0:
        return b""
    data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    if value < 0 and len(data) > 1 and data[-1] == 0xFF and data[-2] & 0x80:
        data = data[:-1]
    return data


class _Writer:
    """One dump: the output buffer, its open frame, the memo."""

    def __init__(self, file: BinaryIO, protocol: int):
        self.file = file
        self.protocol = protocol
        self.out = bytearray()
        self.frame_start = -1
        self.framing = False
        # id -> (memo number, object): the object is kept alive, as the C pickler keeps it.
        self.memo: dict[int, tuple[int, Any]] = {}
        self.count = 0  # memo numbers given out, kept or not
        # The memo of the lazy item being written (None outside lazy items).
        self.transient: dict[int, tuple[int, Any]] | None = None
        # Where saves start in what is being recorded (None: writing for real).
        self.recording: list[int] | None = None
        # Templates whose first instance was written as built (and found to pickle as NEWOBJ).
        self.checked: set[Template] = set()
        # The bytes of a torch.Size by its value, with where inside saves start, and how
        # many memo numbers it takes (torch.Size's class is in the memo by then).
        self.sizes: dict[tuple, tuple[bytes, tuple[int, ...], int]] = {}
        self.parts: dict[Template, tuple[bytes, list[tuple[bytes, bool]], bytes]] = {}
        self.dispatch = {
            Filled: self._save_filled,
            dict: self._save_dict,
            list: self._save_list,
            tuple: self._save_tuple,
            str: self._save_str,
            bytes: self._save_bytes,
            LazyList: self._save_lazy_list,
            LazyDict: self._save_lazy_dict,
        }

    # -- output and frames -------------------------------------------------------------

    def write(self, data: bytes) -> None:
        if self.framing and self.frame_start == -1:
            self.frame_start = len(self.out)
            self.out += b"\xfe" * _FRAME_HEADER
        self.out += data

    def commit_frame(self) -> None:
        if not self.framing or self.frame_start == -1:
            return
        start = self.frame_start
        length = len(self.out) - start - _FRAME_HEADER
        if length >= _FRAME_MIN:
            self.out[start : start + _FRAME_HEADER] = _FRAME + struct.pack("<Q", length)
        else:
            del self.out[start : start + _FRAME_HEADER]
        self.frame_start = -1

    def flush(self) -> None:
        self.commit_frame()
        self.file.write(self.out)
        self.out = bytearray()

    def boundary(self) -> None:
        if self.recording is not None:
            self.recording.append(len(self.out))
            return
        if (
            self.frame_start != -1
            and len(self.out) - self.frame_start - _FRAME_HEADER >= _FRAME_TARGET
        ):
            self.flush()

    def write_recorded(self, data: bytes, starts: tuple[int, ...]) -> None:
        """Write bytes recorded earlier, with frames closed at ``starts`` (where saves began) as due."""
        if self.frame_start != -1 and starts:
            if len(self.out) - self.frame_start - _FRAME_HEADER + starts[-1] >= _FRAME_TARGET:
                done = 0
                for at in starts:
                    if at > done:
                        self.write(data[done:at])
                        done = at
                    self.boundary()
                if done < len(data):
                    self.write(data[done:])
                return
        self.write(data)

    def record(self, obj: Any) -> tuple[bytes, tuple[int, ...], int]:
        """Return the bytes ``save(obj)`` writes here, where its saves start, and its memo numbers.

        Nothing is written out; the memo numbers are taken, as if it had been.
        """
        out, start, framing = self.out, self.frame_start, self.framing
        self.out, self.frame_start, self.framing, self.recording = bytearray(), -1, False, []
        before = self.count
        try:
            self.save(obj)
            return bytes(self.out), tuple(self.recording), self.count - before
        finally:
            self.out, self.frame_start, self.framing, self.recording = out, start, framing, None

    def write_payload(self, header: bytes, data: bytes) -> None:
        """Write a string's or bytes' header and data; 64 KiB or more go outside frames."""
        if len(data) < _FRAME_TARGET:
            self.write(header + data)
            return
        self.commit_frame()
        framing, self.framing = self.framing, False
        self.write(header)
        self.flush()
        self.file.write(data)
        self.framing = framing

    def dump(self, obj: Any) -> None:
        self.write(b"\x80" + bytes([self.protocol]))
        self.framing = True
        self.save(obj)
        self.write(_STOP)
        self.flush()
        self.framing = False

    # -- memo --------------------------------------------------------------------------

    def memo_get(self, obj: Any) -> int | None:
        found = self.memo.get(id(obj))
        if found is None and self.transient is not None:
            found = self.transient.get(id(obj))
        return None if found is None else found[0]

    def memo_put(self, obj: Any, keep: bool) -> None:
        table = self.memo if keep or self.transient is None else self.transient
        table[id(obj)] = (self.count, obj)
        self.count += 1
        self.write(_MEMOIZE)

    def write_get(self, index: int) -> None:
        self.write(_get(index))

    # -- save --------------------------------------------------------------------------

    def save(self, obj: Any) -> None:
        self.boundary()
        kind = type(obj)
        if obj is None:
            self.write(_NONE)
        elif kind is bool:
            self.write(_NEWTRUE if obj else _NEWFALSE)
        elif kind is int:
            self._save_int(obj)
        elif kind is float:
            self.write(_BINFLOAT + struct.pack(">d", obj))
        else:
            index = self.memo_get(obj)
            if index is not None:
                self.write_get(index)
                return
            handler = self.dispatch.get(kind)
            if handler is not None:
                handler(obj)
            else:
                self._save_other(obj)

    def _save_int(self, value: int) -> None:
        if -(2**31) <= value < 2**31:
            if 0 <= value < 256:
                self.write(_BININT1 + bytes([value]))
            elif 0 <= value < 65536:
                self.write(_BININT2 + struct.pack("<H", value))
            else:
                self.write(_BININT + struct.pack("<i", value))
            return
        data = _encode_long(value)
        if len(data) >= 256:
            raise NotStreamable("an int of 256 bytes or more")
        self.write(_LONG1 + bytes([len(data)]) + data)

    def _save_str(self, obj: str) -> None:
        data = obj.encode("utf-8", "surrogatepass")
        self.write_payload(_sized(_UNICODE_OPS, len(data)), data)
        self.memo_put(obj, keep=True)

    def _save_bytes(self, obj: bytes) -> None:
        self.write_payload(_sized(_BYTES_OPS, len(obj)), obj)
        self.memo_put(obj, keep=True)

    def _save_tuple(self, obj: tuple) -> None:
        if not obj:
            self.write(_EMPTY_TUPLE)
            return
        if len(obj) <= 3:
            for item in obj:
                self.save(item)
            if self.memo_get(obj) is not None:
                raise NotStreamable("a tuple that contains itself")
            self.write(_TUPLES[len(obj)])
        else:
            self.write(_MARK)
            for item in obj:
                self.save(item)
            if self.memo_get(obj) is not None:
                raise NotStreamable("a tuple that contains itself")
            self.write(_TUPLE)
        self.memo_put(obj, keep=False)

    def _save_list(self, obj: list) -> None:
        self.write(_EMPTY_LIST)
        self.memo_put(obj, keep=False)
        self._list_items(len(obj), iter(obj), lazy=False)

    def _save_lazy_list(self, obj: LazyList) -> None:
        self.write(_EMPTY_LIST)
        self.memo_put(obj, keep=False)
        self._list_items(obj.length, obj.items(), lazy=True)

    def _list_items(self, length: int, items: Iterator, lazy: bool) -> None:
        if length == 0:
            return
        if length == 1:
            self._item(next(items), lazy)
            self.write(_APPEND)
            return
        total = 0
        while total < length:
            self.write(_MARK)
            batch = 0
            while total < length:
                self._item(next(items), lazy)
                total += 1
                batch += 1
                if batch == _BATCH:
                    break
            self.write(_APPENDS)

    def _save_dict(self, obj: dict) -> None:
        self.write(_EMPTY_DICT)
        self.memo_put(obj, keep=False)
        self._dict_items(len(obj), iter(obj.items()), lazy=False)

    def _save_lazy_dict(self, obj: LazyDict) -> None:
        self.write(_EMPTY_DICT)
        self.memo_put(obj, keep=False)
        self._dict_items(obj.length, obj.items(), lazy=True)

    def _dict_items(self, length: int, items: Iterator, lazy: bool) -> None:
        if length == 0:
            return
        if length == 1:
            self._item(next(items), lazy, pair=True)
            self.write(_SETITEM)
            return
        done = 0
        while True:
            self.write(_MARK)
            batch = 0
            while done < length:
                self._item(next(items), lazy, pair=True)
                done += 1
                batch += 1
                if batch == _BATCH:
                    break
            self.write(_SETITEMS)
            if batch != _BATCH:
                break

    def _item(self, item: Any, lazy: bool, pair: bool = False) -> None:
        """Write one item (or key and value) of a container; a lazy one's objects are forgotten after."""
        if lazy and not pair and type(item) is Filled:
            # The common lazy items: instances given by fields, with no object of their own.
            self._save_filled(item)
            return
        if lazy and pair and type(item[0]) is Filled and type(item[1]) is Filled:
            self._save_filled(item[0])
            self._save_filled(item[1])
            return
        outer = self.transient
        if lazy:
            self.transient = {}
        try:
            if pair:
                self.save(item[0])
                self.save(item[1])
            else:
                self.save(item)
        finally:
            self.transient = outer

    # -- instances given by their fields ---------------------------------------------------

    def _save_filled(self, obj: Filled) -> None:
        template, values = obj
        if template not in self.checked:
            real = template.make(*values)
            _check_newobj(real, template)
            self.save(real)
            self.checked.add(template)
            return
        data = self._filled_bytes(template, values)
        if data is not None and (
            self.frame_start == -1
            or len(self.out) - self.frame_start - _FRAME_HEADER + len(data[0]) < _FRAME_TARGET
        ):
            # No save inside can close a frame: the bytes go as one.
            self.write(data[0])
            self.count += data[1]
            return
        self._save_filled_by_parts(template, values)

    def _filled_bytes(self, template: Template, values: tuple) -> tuple[bytes, int] | None:
        """Return the bytes of a filled instance and its memo numbers; None when a value is new here."""
        head, fields, tail = self._template_parts(template)
        parts, numbers = [head], 2
        sizes, memo = self.sizes, self.memo
        for (key, is_size), value in zip(fields, values):
            parts.append(key)
            if is_size:
                known = sizes.get(value)
                if known is None:
                    return None
                parts.append(known[0])
                numbers += known[2]
                continue
            kind = type(value)
            if kind is int:
                if 0 <= value < 256:
                    parts.append(_BININT1 + bytes((value,)))
                elif 0 <= value < 65536:
                    parts.append(_BININT2 + value.to_bytes(2, "little"))
                elif -(2**31) <= value < 2**31:
                    parts.append(_BININT + value.to_bytes(4, "little", signed=True))
                else:
                    return None
            elif kind is str:
                found = memo.get(id(value))
                if found is None:
                    return None
                index = found[0]
                parts.append(_BINGET + bytes((index,)) if index < 256 else _get(index))
            elif value is None:
                parts.append(_NONE)
            else:
                return None
        parts.append(tail)
        return b"".join(parts), numbers

    def _template_parts(self, template: Template) -> tuple[bytes, list[tuple[bytes, bool]], bytes]:
        """Return the bytes around a template's values (before them, before each, after them)."""
        parts = self.parts.get(template)
        if parts is None:
            many = len(template.fields) > 1
            # As save_reduce writes NEWOBJ of the class with a dict state; the class and
            # the field names are in the memo since the first instance was written.
            head = (
                _get(self.memo[id(template.cls)][0])
                + _EMPTY_TUPLE
                + _NEWOBJ
                + _MEMOIZE
                + _EMPTY_DICT
                + _MEMOIZE
                + (_MARK if many else b"")
            )
            fields = [(_get(self.memo[id(n)][0]), n in template.sizes) for n in template.fields]
            parts = self.parts[template] = (
                head,
                fields,
                (_SETITEMS if many else _SETITEM) + _BUILD,
            )
        return parts

    def _save_filled_by_parts(self, template: Template, values: tuple) -> None:
        """Write a filled instance save by save, closing frames where the C pickler would."""
        self.boundary()
        self.write_get(self.memo[id(template.cls)][0])
        self.boundary()
        self.write(_EMPTY_TUPLE + _NEWOBJ + _MEMOIZE)
        self.boundary()
        self.write(_EMPTY_DICT + _MEMOIZE)
        self.count += 2
        many = len(template.fields) > 1
        if many:
            self.write(_MARK)
        for name, value in zip(template.fields, values):
            self.boundary()
            self.write_get(self.memo[id(name)][0])
            if name in template.sizes:
                self._save_size(value)
            else:
                self.save(value)
        self.write((_SETITEMS if many else _SETITEM) + _BUILD)

    def _save_size(self, value: tuple) -> None:
        """Write ``torch.Size(value)``, from the bytes of the first one of that value."""
        if id(torch.Size) not in self.memo:
            self.save(torch.Size(value))
            return
        known = self.sizes.get(value)
        if known is None:
            # Recording takes its memo numbers already.
            known = self.sizes[value] = self.record(torch.Size(value))
        else:
            self.count += known[2]
        self.write_recorded(known[0], known[1])

    # -- reductions ----------------------------------------------------------------------

    def _save_other(self, obj: Any) -> None:
        # In the C pickler's order: classes and Python functions by name, then copyreg's
        # table, then (metaclass instances) by name, then the object's own reduction.
        kind = type(obj)
        if kind is type or kind is types.FunctionType:
            self._save_global(obj, None)
            return
        reduce = copyreg.dispatch_table.get(kind)
        if reduce is not None:
            value = reduce(obj)
        elif isinstance(obj, type):
            self._save_global(obj, None)
            return
        else:
            reduce_ex = getattr(obj, "__reduce_ex__", None)
            if reduce_ex is None:
                raise NotStreamable(f"a {type(obj).__name__} without __reduce_ex__")
            value = reduce_ex(self.protocol)
        if isinstance(value, str):
            self._save_global(obj, value)
            return
        if not isinstance(value, tuple) or not 2 <= len(value) <= 6:
            raise NotStreamable(f"{type(obj).__name__}'s reduction")
        self._save_reduce(obj, *value)

    def _save_reduce(
        self, obj, func, args, state=None, listitems=None, dictitems=None, setter=None
    ) -> None:
        if listitems is not None or dictitems is not None or setter is not None:
            raise NotStreamable(f"{type(obj).__name__}'s reduction with items or a state setter")
        if getattr(func, "__name__", "") == "__newobj__":
            cls = args[0]
            if not isinstance(cls, type) or cls is not type(obj):
                raise NotStreamable(f"{type(obj).__name__}'s __newobj__ arguments")
            self.save(cls)
            self.save(args[1:])
            self.write(_NEWOBJ)
        elif getattr(func, "__name__", "") == "__newobj_ex__":
            raise NotStreamable("__newobj_ex__")
        else:
            self.save(func)
            self.save(args)
            self.write(_REDUCE)
        if self.memo_get(obj) is not None:
            raise NotStreamable(f"a {type(obj).__name__} that contains itself")
        self.memo_put(obj, keep=not self._is_value(obj, func))
        if state is not None:
            self.save(state)
            self.write(_BUILD)

    @staticmethod
    def _is_value(obj: Any, func: Any) -> bool:
        """Return whether ``obj`` is made afresh for where it appears (an instance, a ``torch.Size``)."""
        return getattr(func, "__name__", "") == "__newobj__" or type(obj) is torch.Size

    def _save_global(self, obj: Any, name: str | None) -> None:
        if name is None:
            name = getattr(obj, "__qualname__", None)
            if name is None:
                raise NotStreamable(f"{obj!r} has no __qualname__")
        module = _which_module(obj, name)
        if (module, name) in copyreg._extension_registry:  # type: ignore[attr-defined]
            raise NotStreamable("a global in copyreg's extension registry")
        self.save(module)
        self.save(name)
        self.write(_STACK_GLOBAL)
        self.memo_put(obj, keep=True)


def _get(index: int) -> bytes:
    """Return the memo reference to memo number ``index``."""
    if index < 256:
        return _BINGET + bytes((index,))
    return _LONG_BINGET + struct.pack("<I", index)


def _check_newobj(obj: Any, template: Template) -> None:
    """Raise ``NotStreamable`` unless ``obj`` pickles as ``template`` says: NEWOBJ, its fields as state."""
    reduced = obj.__reduce_ex__(4)
    func, args, state = (*reduced, None, None)[:3]
    rest = reduced[3:]
    if (
        getattr(func, "__name__", "") != "__newobj__"
        or args != (template.cls,)
        or type(obj) is not template.cls
        or type(state) is not dict
        or tuple(state) != template.fields
        or any(a is not b for a, b in zip(state, template.fields))
        or any(sys.intern(name) is not name for name in state)
        or any(r is not None for r in rest)
        or any(type(state[name]) is not torch.Size for name in template.sizes)
    ):
        raise NotStreamable(f"a {template.cls.__name__} does not pickle as its template says")


def _which_module(obj: Any, name: str) -> str:
    """Return the module name the C pickler records for global ``obj`` (its ``whichmodule``)."""
    module = getattr(obj, "__module__", None)
    if module is not None:
        return module
    for module_name, module_obj in list(sys.modules.items()):
        if module_name == "__main__" or module_obj is None:
            continue
        found: Any = module_obj
        for part in name.split("."):
            found = getattr(found, part, None)
        if found is obj:
            return module_name
    return "__main__"


__all__ = [
    "Filled",
    "LazyDict",
    "LazyList",
    "NotStreamable",
    "Template",
    "dump",
    "filled",
    "materialized",
]
