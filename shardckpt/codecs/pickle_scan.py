"""Pickles read as opcodes, never run: what a file's pickle names, and why a load of it failed.

``pickletools`` decodes each opcode and its argument and calls nothing, so everything
here is safe on any file, trusted or not. Two uses:

- detection (``scan_torch_file``): the globals and strings of a ``torch.save`` file's
  pickle tell its format without loading it;
- error messages (``judge_failed_load``): a pickle that decodes but that torch's
  ``weights_only`` loader refused is *unsafe* (``--trust-pickle`` would load it), one
  that does not decode is *damaged* (nothing would load it; re-copy it).
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import pickle
import pickletools
import re
import types
import warnings
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import BinaryIO, Literal

TRUST_HINT = "pass --trust-pickle only if you trust this file"
"""The hint of every pickle refused because it names something outside the allow-list."""

ATTRIBUTE_BAGS = (argparse.Namespace, types.SimpleNamespace)
"""Plain attribute holders every weights-only load admits beside torch's allow-list.

Loading one only sets attributes (torch's loader makes the object and updates its
``__dict__``); Megatron keeps its command line (``args``) in an ``argparse.Namespace``.
"""

_ZIP_MAGIC = b"PK\x03\x04"
MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
"""``torch.serialization.MAGIC_NUMBER``: the first pickle of a legacy ``torch.save`` file."""
# torch.save(_use_new_zipfile_serialization=False) writes five pickles before the tensor
# bytes: magic number, protocol version, system info, the object, its storage keys.
_LEGACY_PICKLES = 5
_STRING_OPS = {
    "UNICODE",
    "SHORT_BINUNICODE",
    "BINUNICODE",
    "BINUNICODE8",
    "STRING",
    "BINSTRING",
    "SHORT_BINSTRING",
}
_PUT_OPS = {"PUT", "BINPUT", "LONG_BINPUT"}
_GET_OPS = {"GET", "BINGET", "LONG_BINGET"}


class DamagedPickle(Exception):
    """A pickle (or the zip it is stored in) that does not decode: damaged, not unsafe."""


class DamagedZip(DamagedPickle):
    """A ``torch.save`` zip that does not read: torch's own zip reader may read it otherwise, so nothing of it is loaded."""


class NotTorchFile(Exception):
    """Bytes that are neither a ``torch.save`` zip nor a legacy ``torch.save`` pickle stream."""


class CompressedRecord(NotTorchFile):
    """A zip with a compressed record, which ``torch.save`` never writes.

    ``torch.load`` would inflate such a ``data.pkl`` whatever size it claims, and reads
    a memory-mapped compressed tensor record as if its bytes were the tensor's.
    """

    def __init__(self, name: str, method: int):
        self.name = name
        self.method = _METHODS.get(method, f"method {method}")
        super().__init__(f"record {name!r} is compressed ({self.method})")


_METHODS = {zipfile.ZIP_DEFLATED: "deflate", zipfile.ZIP_BZIP2: "bzip2", zipfile.ZIP_LZMA: "lzma"}


@dataclass(frozen=True)
class Scan:
    """What a pickle names: its globals as ``module.name`` and its string constants (dict keys among them)."""

    globals: frozenset[str]
    strings: frozenset[str]


def scan(stream: BinaryIO) -> Scan:
    """Return the globals and strings of the pickle at ``stream``'s position; read up to its STOP.

    A ``STACK_GLOBAL`` (protocol 4) takes its module and name from the two strings
    pushed before it, memoized or not, as ``pickle.dumps`` writes them.
    """
    names: set[str] = set()
    strings: set[str] = set()
    memo: dict[object, str | None] = {}
    pushed: list[str | None] = [None, None]
    try:
        for op, arg, _ in pickletools.genops(stream):
            if op.name in _STRING_OPS:
                text = arg.decode("latin-1") if isinstance(arg, bytes) else arg
                strings.add(text)
                pushed.append(text)
            elif op.name == "GLOBAL":
                names.add(arg.replace(" ", ".", 1))
                pushed.append(None)
            elif op.name == "STACK_GLOBAL":
                module, name = pushed[-2], pushed[-1]
                names.add(f"{module}.{name}" if module and name else "?")
                pushed.append(None)
            elif op.name == "MEMOIZE":
                memo[len(memo)] = pushed[-1]
            elif op.name in _PUT_OPS:
                memo[arg] = pushed[-1]
            elif op.name in _GET_OPS:
                pushed.append(memo.get(arg))
            elif op.stack_after:
                pushed.append(None)
            del pushed[:-2]
    except (ValueError, EOFError) as exc:
        raise DamagedPickle(str(exc)) from None
    return Scan(frozenset(names), frozenset(strings))


def check(stream: BinaryIO) -> None:
    """Raise ``DamagedPickle`` unless the pickle at ``stream``'s position decodes, stack and memo consistent.

    ``pickletools.dis`` simulates the stack and memo opcode by opcode (calling nothing),
    so a flipped or cut byte is caught even where each opcode alone would decode.
    """
    try:
        pickletools.dis(stream, out=_Discard())
    except (ValueError, EOFError) as exc:
        raise DamagedPickle(str(exc)) from None


class _Discard(io.TextIOBase):
    """A text sink for ``pickletools.dis``'s listing, which is not wanted."""

    def write(self, s: str) -> int:
        return len(s)


@contextmanager
def torch_pickles(source: str | os.PathLike | BinaryIO) -> Iterator[list[BinaryIO]]:
    """Yield the pickles of a ``torch.save`` file or stream, each as a stream at its start.

    A zip's ``data.pkl`` is read whole, so its CRC is checked, and every record named so
    is listed: torch's zip reader matches names regardless of case, and which of two it
    takes is its own affair. The legacy format's five pickles follow each other in one
    stream, so that stream is listed five times and each reader of one pickle leaves it
    at the start of the next.
    """
    with opened(source) as stream:
        head = stream.read(4)
        stream.seek(0)
        if head == _ZIP_MAGIC:
            yield [io.BytesIO(data) for data in _data_pkls(stream)]
        elif head[:1] == pickle.PROTO and _starts_with_magic(stream):
            stream.seek(0)
            yield [stream] * _LEGACY_PICKLES
        else:
            raise NotTorchFile("neither a torch.save zip nor a legacy torch.save file")


@contextmanager
def opened(source: str | os.PathLike | BinaryIO) -> Iterator[BinaryIO]:
    """Yield ``source`` as a binary stream at its start: a path opened, a stream rewound (before and after)."""
    if isinstance(source, (str, os.PathLike)):
        from shardckpt.core.files import is_remote_file, source_stream

        # A URL SRC's stand-in is read from the store, through core.files.
        with source_stream(source) if is_remote_file(source) else open(source, "rb") as f:
            yield f
    else:
        source.seek(0)
        try:
            yield source
        finally:
            source.seek(0)


def _starts_with_magic(stream: BinaryIO) -> bool:
    """Return whether the first pickle is the legacy format's magic number (a plain pickle is not)."""
    try:
        return any(arg == MAGIC_NUMBER for _, arg, _ in pickletools.genops(stream))
    except (ValueError, EOFError) as exc:
        raise DamagedPickle(str(exc)) from None


def _data_pkls(stream: BinaryIO) -> list[bytes]:
    """Return the ``data.pkl`` records of a zip, read as stored; nothing is ever inflated."""
    try:
        with zipfile.ZipFile(stream) as zf:
            return zip_pickles(zf, stream.seek(0, os.SEEK_END))
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError) as exc:
        raise DamagedZip(f"zip: {exc}") from None


def zip_pickles(zf: zipfile.ZipFile, size: int) -> list[bytes]:
    """Return the ``data.pkl`` records of ``zf`` (an open zip of ``size`` bytes), read as stored.

    Raises ``CompressedRecord`` for a record not stored as ``torch.save`` stores each,
    ``DamagedZip`` for one that does not fit, ``NotTorchFile`` when none is ``data.pkl``.
    """
    try:
        for info in zf.infolist():
            _check_stored(info, size)
        names = [i for i in zf.infolist() if i.filename.lower().endswith("data.pkl")]
        if not names:
            raise NotTorchFile("a zip without data.pkl")
        return [zf.read(info) for info in names]
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError) as exc:
        raise DamagedZip(f"zip: {exc}") from None


def _check_stored(info: zipfile.ZipInfo, size: int) -> None:
    """Raise unless ``info`` is a stored record (as ``torch.save`` writes each) that fits in a zip of ``size`` bytes."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise CompressedRecord(info.filename, info.compress_type)
    if info.file_size != info.compress_size or info.header_offset + info.file_size > size:
        raise DamagedZip(
            f"zip: record {info.filename!r} claims {info.file_size:,} bytes, which a file of "
            f"{size:,} bytes cannot hold"
        )


def scan_torch_file(source: str | os.PathLike | BinaryIO) -> Scan:
    """Return what the pickles of a ``torch.save`` file name; raise ``DamagedPickle`` or ``NotTorchFile``."""
    names: set[str] = set()
    strings: set[str] = set()
    with torch_pickles(source) as pickles:
        for stream in pickles:
            found = scan(stream)
            names |= found.globals
            strings |= found.strings
    return Scan(frozenset(names), frozenset(strings))


def damage(source: str | os.PathLike | BinaryIO) -> str | None:
    """Return what is damaged in a ``torch.save`` file's pickles, or None when they all decode."""
    try:
        with torch_pickles(source) as pickles:
            for stream in pickles:
                check(stream)
    except DamagedPickle as exc:
        return str(exc)
    return None


@dataclass(frozen=True)
class LoadFailure:
    """Why ``torch.load`` failed: ``refused`` (unsafe), ``damaged``, ``missing`` (a module it
    imports is not installed) or ``unreadable`` (another format, or other)."""

    kind: Literal["refused", "damaged", "unreadable", "missing"]
    reason: str
    """For ``missing``: the name of the module the pickle needs that is not installed."""


def judge_failed_load(
    exc: BaseException, source: str | os.PathLike | BinaryIO, trust_pickle: bool
) -> LoadFailure:
    """Return why ``torch.load(source, weights_only=not trust_pickle)`` raised ``exc``.

    Only a pickle that decodes can have been refused for what it names; with
    ``--trust-pickle`` nothing is refused, so no failure is ever ``refused`` then.
    """
    try:
        broken = damage(source)
    except (NotTorchFile, OSError):
        return LoadFailure("unreadable", first_line(exc))
    if broken is not None:
        return LoadFailure("damaged", broken)
    if isinstance(exc, pickle.UnpicklingError) and not trust_pickle:
        return LoadFailure("refused", refusal_reason(exc))
    # Only a pickle that is run (--trust-pickle) imports the modules it names.
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        return LoadFailure("missing", exc.name)
    return LoadFailure("unreadable", first_line(exc))


_GLOBAL = re.compile(r"GLOBAL (\S+) (?:was not an allowed global|whose module)")
_OPERAND = re.compile(r"^Unsupported operand (\d+)")


def refusal_reason(exc: BaseException) -> str:
    """Return the reason torch's ``weights_only`` loader gave, in a few words.

    torch wraps its loader's message in paragraphs of advice about ``weights_only``
    and ``add_safe_globals``; the reason is the last line before its documentation link.
    """
    text = str(exc).split("\n\nCheck the documentation of torch.load")[0]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    reason = lines[-1] if lines else type(exc).__name__
    reason = reason.split("WeightsUnpickler error: ", 1)[-1]
    if m := _GLOBAL.search(reason):
        name = m.group(1)
        # torch prints builtins.exec as "exec"
        return f"names {name if '.' in name else 'builtins.' + name}, not on the weights-only allow-list"
    if m := _OPERAND.match(reason):
        op = pickletools.code2op.get(chr(int(m.group(1))))
        what = op.name if op else f"#{m.group(1)}"
        return f"uses pickle opcode {what}, which weights-only loading does not read"
    return reason.split(". ")[0].rstrip(".")


@contextmanager
def quiet_protocol_warning() -> Iterator[None]:
    """Silence what torch says while a file loads: that a pickle is not protocol 2 (the
    load's error, if any, says more), and (torch 2.15) that a DeviceMesh was unpickled
    before its process groups exist, which every per-rank file read outside its job is."""
    mesh_log = logging.getLogger("torch.distributed.device_mesh")
    level = mesh_log.level
    mesh_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            yield
    finally:
        mesh_log.setLevel(level)


def first_line(exc: BaseException) -> str:
    """Return ``Type: first line of the message`` of ``exc``."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
