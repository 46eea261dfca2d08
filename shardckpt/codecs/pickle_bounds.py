"""What unpickling a pickle would build, measured from its opcodes before anything is built.

A pickle is a small program, and its memo lets it use an object again for the price of
a two-byte reference: about 200 bytes describe a tuple 40 levels deep whose every level
holds the one below twice. Unpickling builds it in microseconds, but whatever then
hashes it (as a dict key, while unpickling), compares, prints or walks it visits 2**40
objects, and a hash runs inside C, where no signal is acted on. So before any
unpickler sees a pickle, ``check_pickle`` decodes its opcodes (calling nothing, as
``pickletools`` does), follows which object each one makes and which objects each
object holds (a memo reference is the same object again), and refuses the pickle when
what it builds, each object counted at every use, has more parts than
``PARTS_PER_BYTE`` per byte of pickle (and at least ``MIN_PARTS``), or nests deeper
than ``MAX_DEPTH``. A checkpoint's pickle is a tree whose shared parts are small (a
class, a repeated key, a tied tensor): it builds fewer parts than it has bytes.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickletools
import tarfile
import zipfile
from array import array
from collections import OrderedDict
from typing import BinaryIO

from shardckpt.codecs.pickle_scan import (
    CompressedRecord,
    DamagedPickle,
    DamagedZip,
    NotTorchFile,
    opened,
    torch_pickles,
    zip_pickles,
)
from shardckpt.core.errors import BadInputError
from shardckpt.core.sight import note_metadata
from shardckpt.state.tree import too_deep

MAX_DEPTH = 1000
"""Objects nested deeper than this are refused: Python's own recursion stops at 1000 levels."""
PARTS_PER_BYTE = 16
"""How many parts one byte of pickle may build, each object counted at every use."""
MIN_PARTS = 1 << 20
"""The parts any pickle may build, however short: a small file stays quick to read."""
_BYTES_PER_PART = 64
"""A string, bytes or int counts one part per this many bytes of it, as printing it costs."""
_CAP = 1 << 62
"""Counts stop growing here: far above any limit, and cheap to add."""
_MAX_STREAMED = 1 << 30
"""The longest pickle read from a stream (a legacy ``torch.save`` file's): no checkpoint's is near."""
# Digests of pickles that passed ``check_pickle``, newest last: the verdict is a function
# of the bytes alone, and a DCP save's chunks repeat a few pickles (one per shape) over
# and over; 94,700 chunks of a 64-rank save were scanned one by one.
_PASSED: OrderedDict[bytes, int] = OrderedDict()  # the digest, and the pickle's length
_PASSED_KEPT = 4096


class _Stop(Exception):
    """The opcodes do not decode, or do not fit the stack or memo: an unpickler stops there too."""


class _Shape:
    """The objects a pickle builds: each container's parts, counted as they are added.

    A container (list, dict, set, a tuple or an object built from others) is a node, an
    index into the per-node arrays; a leaf (number, string, class) is a negative int,
    minus its weight. A node's parts are counted when added, so its count is final when
    another node takes it as a part, unless an opcode adds parts to it after that
    (APPEND or BUILD on a shared object, or a cycle): then ``stale`` is set and
    ``measure`` counts the whole graph again from its edges.
    """

    def __init__(self) -> None:
        self.base = array("q")  # its own weight and its leaves'
        self.size = array("q")  # its parts, every node counted at each use
        self.depth = array("q")
        self.held = bytearray()  # whether another node holds it
        self.edges: tuple[array, array] = (array("q"), array("q"))  # (holder, part) pairs
        self.stale = False

    def node(self, parts: list[int]) -> int:
        """Return a new container holding ``parts`` (each made before it: none is the new one)."""
        held = self.held
        new = len(held)
        held.append(0)
        base = total = below = 1
        if parts:
            size, depth = self.size, self.depth
            holders, held_parts = self.edges
            below = 0
            for part in parts:
                if part < 0:
                    base -= part
                    total -= part
                    continue
                total += size[part]
                if depth[part] > below:
                    below = depth[part]
                held[part] = 1
                holders.append(new)
                held_parts.append(part)
            below += 1
        self.base.append(base)
        self.size.append(total if total < _CAP else _CAP)
        self.depth.append(below)
        return new

    def add(self, into: int, parts: list[int]) -> None:
        """Count ``parts`` into node ``into``."""
        size, held = self.size, self.held
        if held[into]:
            self.stale = True
        total, below = size[into], self.depth[into] - 1
        for part in parts:
            if part < 0:
                self.base[into] -= part
                total -= part
                continue
            if part == into:
                self.stale = True
            total += size[part]
            if self.depth[part] > below:
                below = self.depth[part]
            held[part] = 1
            self.edges[0].append(into)
            self.edges[1].append(part)
        size[into] = total if total < _CAP else _CAP
        self.depth[into] = below + 1

    def measure(self) -> tuple[int, int]:
        """Return the parts of everything built, each object counted at every use, and the deepest nesting.

        An object is counted inside every object that holds it, and once more on its own
        where nothing holds it: a dict key is hashed at each insertion, even into a dict
        the pickle then drops.
        """
        if self.stale:
            self._recount()
        roots = (size for size, held in zip(self.size, self.held) if not held)
        return min(sum(roots), _CAP), max(self.depth, default=0)

    def _recount(self) -> None:
        """Count every node's parts again from the edges, depth first from the nodes nothing holds.

        A part that holds what holds it (a cycle) is not counted again; a cycle that
        nothing outside it holds is counted from its first node, as a root.
        """
        count = len(self.size)
        parts: list[list[int]] = [[] for _ in range(count)]
        held = bytearray(count)
        for holder, part in zip(*self.edges):
            parts[holder].append(part)
            held[part] = 1
        size, depth = self.size, self.depth
        state = bytearray(count)  # 0 unseen, 1 being counted, 2 counted
        firsts = [n for n in range(count) if not held[n]] + list(range(count))
        for first in firsts:
            if state[first]:
                continue
            held[first] = 0
            todo = [first]
            while todo:
                node = todo[-1]
                if state[node] == 0:
                    state[node] = 1
                    todo.extend(p for p in parts[node] if state[p] == 0)
                    continue
                todo.pop()
                if state[node] == 2:
                    continue
                state[node] = 2
                total, below = self.base[node], 0
                for part in parts[node]:
                    if state[part] == 2:
                        total = min(total + size[part], _CAP)
                        below = max(below, depth[part])
                size[node], depth[node] = total, below + 1
        self.held = held


# How each opcode's argument is laid out: a fixed number of bytes (>= 0), or one of these.
_LINE, _TWO_LINES, _LEN1, _LEN4, _LEN4U, _LEN8 = -1, -2, -3, -4, -5, -6
_LAYOUTS = {
    "decimalnl_short": _LINE, "decimalnl_long": _LINE, "stringnl": _LINE,
    "stringnl_noescape": _LINE, "unicodestringnl": _LINE, "floatnl": _LINE,
    "stringnl_noescape_pair": _TWO_LINES, "long1": _LEN1, "string1": _LEN1, "bytes1": _LEN1,
    "unicodestring1": _LEN1, "long4": _LEN4, "string4": _LEN4, "bytes4": _LEN4U,
    "unicodestring4": _LEN4U, "bytes8": _LEN8, "unicodestring8": _LEN8, "bytearray8": _LEN8,
}  # fmt: skip
_WIDTHS = {_LEN1: 1, _LEN4: 4, _LEN4U: 4, _LEN8: 8}
"""How many bytes give the length of a length-prefixed argument."""

# What each opcode does to the stack (``pickletools.opcodes`` describes each).
(_LEAF, _NEW, _GET, _PUT, _MEMOIZE, _FROM_MARK, _FROM_STACK, _GROW_FROM_MARK,
 _GROW_FROM_STACK, _MARK, _POP, _POP_MARK, _DUP, _STACK_GLOBAL, _NOTHING, _STOP) = range(16)  # fmt: skip
_ACTIONS = {
    _NEW: ("EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET"),
    _GET: ("GET", "BINGET", "LONG_BINGET"),
    _PUT: ("PUT", "BINPUT", "LONG_BINPUT"),
    _MEMOIZE: ("MEMOIZE",),
    _FROM_MARK: ("TUPLE", "LIST", "DICT", "FROZENSET", "INST", "OBJ"),
    _FROM_STACK: ("TUPLE1", "TUPLE2", "TUPLE3", "REDUCE", "NEWOBJ", "NEWOBJ_EX", "BINPERSID"),
    _GROW_FROM_MARK: ("APPENDS", "SETITEMS", "ADDITEMS"),
    _GROW_FROM_STACK: ("APPEND", "SETITEM", "BUILD"),
    _MARK: ("MARK",),
    _POP: ("POP",),
    _POP_MARK: ("POP_MARK",),
    _DUP: ("DUP",),
    _STACK_GLOBAL: ("STACK_GLOBAL",),
    _NOTHING: ("PROTO", "FRAME", "READONLY_BUFFER"),
    _STOP: ("STOP",),
}
_TAKES = {
    "TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3, "REDUCE": 2, "NEWOBJ": 2, "NEWOBJ_EX": 3,
    "BINPERSID": 1, "APPEND": 1, "SETITEM": 2, "BUILD": 1,
}  # fmt: skip
"""How many stack entries each opcode of ``_FROM_STACK`` and ``_GROW_FROM_STACK`` takes."""


def _table() -> list[tuple[int, int, int] | None]:
    """Return, by opcode byte, its action, its argument's layout and how many entries it takes."""
    action_of = {name: action for action, names in _ACTIONS.items() for name in names}
    table: list[tuple[int, int, int] | None] = [None] * 256
    for op in pickletools.opcodes:
        layout = 0 if op.arg is None else _LAYOUTS[op.arg.name] if op.arg.n < 0 else op.arg.n
        table[ord(op.code)] = (action_of.get(op.name, _LEAF), layout, _TAKES.get(op.name, 0))
    return table


_TABLE = _table()


def _scan(data: bytes) -> tuple[_Shape, int]:
    """Return what the pickle at the start of ``data`` builds, and the offset after its STOP.

    Stops early, without an error, where the bytes do not decode or do not fit the stack
    or memo: an unpickler stops there too. The offset is then where decoding stopped
    (``-1`` when the data ended first, so a longer read may find more). The stack and
    the MARKs are kept as unpicklers keep them: a MARK starts a new stack.
    """
    shape = _Shape()
    node = shape.node
    stack: list[int] = []
    below: list[list[int]] = []  # the stacks under each MARK not yet popped
    memo: dict[int, int] = {}
    end, i = len(data), 0
    try:
        while i < end:
            entry = _TABLE[data[i]]
            if entry is None:
                return shape, i
            action, layout, takes = entry
            if layout >= 0:
                start = i + 1
                i = start + layout
            else:
                start, i = _argument(data, i + 1, layout)
            if i > end:
                return shape, -1
            if action == _LEAF:
                stack.append(-1 - (i - start) // _BYTES_PER_PART)
            elif action == _GET:
                stack.append(memo[data[start] if layout == 1 else _index(data, start, i, layout)])
            elif action == _MEMOIZE:
                memo[len(memo)] = stack[-1]
            elif action == _FROM_STACK:
                parts = stack[-takes:]
                if len(parts) < takes:
                    return shape, i
                del stack[-takes:]
                stack.append(node(parts))
            elif action == _GROW_FROM_STACK:
                if len(stack) <= takes:  # the parts, and the object they go into
                    return shape, i
                parts = stack[-takes:]
                del stack[-takes:]
                _grow(shape, stack, parts)
            elif action == _MARK:
                below.append(stack)
                stack = []
            elif action in (_FROM_MARK, _GROW_FROM_MARK, _POP_MARK):
                parts, stack = stack, below.pop()
                if action == _FROM_MARK:
                    stack.append(node(parts))
                elif action == _GROW_FROM_MARK:
                    _grow(shape, stack, parts)
            elif action == _NEW:
                stack.append(node([]))
            elif action == _PUT:
                memo[_index(data, start, i, layout)] = stack[-1]
            elif action == _POP:
                stack.pop()
            elif action == _DUP:
                stack.append(stack[-1])
            elif action == _STACK_GLOBAL:  # a module and a name string make a class
                if len(stack) < 2:
                    return shape, i
                del stack[-2:]
                stack.append(-1)
            elif action == _STOP:
                return shape, i
        return shape, -1
    except (_Stop, IndexError, KeyError, ValueError):
        return shape, i


def _grow(shape: _Shape, stack: list[int], parts: list[int]) -> None:
    """Add ``parts`` to the object on top of ``stack`` (APPEND, SETITEM, BUILD and kin).

    A leaf given parts (a class whose state BUILD sets) becomes a node from here on.
    """
    into = stack[-1]
    if into < 0:
        into = stack[-1] = shape.node([into])
    shape.add(into, parts)


def _argument(data: bytes, i: int, layout: int) -> tuple[int, int]:
    """Return where the argument at ``i`` starts and ends (past ``len(data)`` when cut)."""
    if layout >= 0:
        return i, i + layout
    if layout in (_LINE, _TWO_LINES):
        stop = data.find(b"\n", i)
        if stop >= 0 and layout == _TWO_LINES:
            stop = data.find(b"\n", stop + 1)
        return i, (stop + 1 if stop >= 0 else len(data) + 1)
    width = _WIDTHS[layout]
    if i + width > len(data):
        return i, len(data) + 1
    length = int.from_bytes(data[i : i + width], "little", signed=layout == _LEN4)
    if length < 0:
        raise _Stop
    return i + width, i + width + length


def _index(data: bytes, start: int, stop: int, layout: int) -> int:
    """Return a memo index: a line of decimal text (GET, PUT), or a little-endian number.

    Python's unpicklers read the line as ``int`` does; the memo is theirs to fill.
    """
    if layout == _LINE:
        return int(data[start : stop - 1])
    return int.from_bytes(data[start:stop], "little")


def check_pickle(
    source: bytes | BinaryIO, path: str | os.PathLike, *, metadata: bool = False
) -> None:
    """Return when unpickling the pickle at ``source`` builds what a checkpoint's may; else raise one line naming ``path``.

    ``source`` is the pickle's bytes, or a stream at its start, left after its STOP. A
    pickle that does not decode is measured up to where it stops decoding, which is
    where an unpickler stops too; saying that it is damaged is left to the loader.
    ``metadata``: the pickle is (part of) file ``path``'s metadata, read whole by every
    rank that reads the file, so its digest is noted for the ranks to compare
    (``core.sight.note_metadata``); not so an item of a data file, read by some ranks.
    """
    stream = None
    if isinstance(source, io.BytesIO) and source.tell() == 0:
        # A record read whole (a zip's data.pkl): checked as bytes, left after its STOP.
        stream, source = source, source.getvalue()
        if len(source) > _MAX_STREAMED:
            stream, source = None, stream
    if isinstance(source, (bytes, bytearray)):
        digest = hashlib.blake2b(source, digest_size=32).digest()
        if metadata:
            note_metadata(path, digest)
        length = _PASSED.get(digest)
        if length is None:
            shape, end = _scan(bytes(source))
            length = len(source) if end < 0 else end
            _judge(shape, length, path)
            _PASSED[digest] = length
            if len(_PASSED) > _PASSED_KEPT:
                _PASSED.popitem(last=False)
        else:
            _PASSED.move_to_end(digest)
        if stream is not None:
            stream.seek(length)
        return
    shape, length = _scan_stream(source, path, metadata)
    _judge(shape, length, path)


def _judge(shape: _Shape, length: int, path: str | os.PathLike) -> None:
    """Raise one line naming ``path`` unless a pickle of ``length`` bytes that builds ``shape`` may be a checkpoint's."""
    if length < 0:
        raise BadInputError(
            f"holds a pickle longer than {_MAX_STREAMED:,} bytes, which no checkpoint's is",
            path=path,
            hint="no training job writes such a pickle; do not load this file, with "
            "--trust-pickle or without",
        )
    parts, deepest = shape.measure()
    if deepest > MAX_DEPTH:
        raise too_deep(path)
    allowed = max(MIN_PARTS, PARTS_PER_BYTE * length)
    if parts > allowed:
        raise BadInputError(
            f"holds a pickle too large to be a checkpoint's (it builds {parts:,} objects, each "
            f"counted at every use; {length:,} bytes of pickle may build {allowed:,})",
            path=path,
            hint="no training job writes such a pickle; do not load this file, with "
            "--trust-pickle or without",
        )


def _scan_stream(stream: BinaryIO, path: str | os.PathLike, metadata: bool) -> tuple[_Shape, int]:
    """Return what the pickle at ``stream``'s position builds and its length; leave the stream after it.

    The pickle's length is not known before its STOP (a legacy ``torch.save`` stream
    holds five, then the tensors' bytes), so a window twice as large is read until it
    holds the STOP or the stream ends; length -1 when ``_MAX_STREAMED`` bytes hold none.
    """
    start, window = stream.tell(), 1 << 20
    while window <= _MAX_STREAMED:
        stream.seek(start)
        data = stream.read(window)
        shape, end = _scan(data)
        if end >= 0 or len(data) < window:
            length = end if end >= 0 else len(data)
            if metadata:
                note_metadata(path, hashlib.blake2b(data[:length], digest_size=32).digest())
            stream.seek(start + length)
            return shape, length
        window *= 2
    return shape, -1


def check_torch_file(source: str | os.PathLike | BinaryIO, path: str | os.PathLike) -> None:
    """Return when every pickle ``torch.load`` would unpickle from ``source`` (a file or a stream) passes ``check_pickle``; else raise one line naming ``path``.

    Raises ``DamagedZip`` for a zip that does not read (the caller says it is damaged).
    A zip's records must be stored, as ``torch.save`` writes them, so nothing is ever
    inflated. Bytes that are no zip are what ``torch.load`` takes for its legacy format:
    it unpickles their first pickle before it can tell, so that pickle is checked too.
    The pickles of a whole file (``source`` a path) are its metadata (``check_pickle``).
    """
    metadata = isinstance(source, (str, os.PathLike))
    try:
        with torch_pickles(source) as pickles:
            for stream in pickles:
                check_pickle(stream, path, metadata=metadata)
        return
    except CompressedRecord as exc:
        raise _compressed(exc, path) from None
    except DamagedZip:
        raise
    except (NotTorchFile, DamagedPickle):
        pass
    with opened(source) as stream:
        if _is_tar(stream):
            raise BadInputError(
                "is a torch.save file in the tar format of torch before 0.1.10, which shardckpt "
                "does not read",
                path=path,
                hint="load it with that torch and save it again with a current one",
            )
        stream.seek(0)
        check_pickle(stream, path, metadata=metadata)


def check_torch_zip(zf: zipfile.ZipFile, size: int, path: str | os.PathLike) -> list[bytes]:
    """``check_torch_file`` for a ``torch.save`` zip already open (``zf``, of ``size`` bytes); return its ``data.pkl`` records.

    The zip's directory is read once, by the caller's reader. Raises ``DamagedZip`` for a
    record that does not fit and ``NotTorchFile`` for a zip without ``data.pkl``, which
    no ``torch.save`` writes either.
    """
    try:
        pickles = zip_pickles(zf, size)
    except CompressedRecord as exc:
        raise _compressed(exc, path) from None
    for data in pickles:
        check_pickle(data, path)
    return pickles


def _compressed(exc: CompressedRecord, path: str | os.PathLike) -> BadInputError:
    return BadInputError(
        f"{exc}, which torch.save never writes",
        path=path,
        hint="save it again with torch.save, or re-zip it without compression (zip -0)",
    )


def _is_tar(stream: BinaryIO) -> bool:
    """Return whether ``stream`` is an uncompressed tar archive with a member, as ``torch.load`` tries first.

    Zeros read as an empty archive, from which torch unpickles nothing.
    """
    try:
        with tarfile.open(fileobj=stream, mode="r:") as tar:
            return tar.next() is not None
    except tarfile.TarError:
        return False
