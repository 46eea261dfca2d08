"""CRC-32 checks of what is read: each record's bytes against the checksum written with them.

torch writes a CRC-32 for every record of every ``torch.save`` zip (each ``.pt``, each
DCP item) and never checks it; shardckpt writes one per tensor into the safetensors
files it makes. A reader that reads bytes of such a span (a ``Written``) tells the
command's ``Ledger`` (``note``), which CRCs them as they arrive, with no second pass
over them; the spans one process read of a record are kept disjoint (a byte read twice
is CRC'd once). At the end of a command every rank's spans go to the coordinator
(``judge``), which looks for a chain of spans from the record's first byte to its last,
combines their CRCs along it (``crc32_combine``) and compares with each one written.
Where a little is missing (a shard's padding no tensor views), the coordinator reads it
(``next_gap``, ``engine.read_checks``). A record read mostly in part (``--only`` or
``--filter`` leaving some of it unread, a tensor viewing a small part of its storage) is
not judged; ``shardckpt verify`` reads every record whole.

One ledger per command (``checking``), found by the readers through ``active()``:
readers are built in many places and nest (a trainer's directory holds DCP data and
``torch.save`` files), and a context is what they all share without each handing it on.
``SHARDCKPT_CHECKSUMS=0`` turns the checks off (to measure what they cost).
"""

from __future__ import annotations

import bisect
import os
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from isal import isal_zlib

from shardckpt.core.files import open_source, read_exactly
from shardckpt.core.lazy_torch import torch

Key = tuple[str, int]
"""A written span by the file it is in and the offset of its first byte."""
Span = tuple[int, int, int]
"""Bytes read of a written span: (offset into it, length, their CRC-32)."""


@dataclass(frozen=True)
class Written:
    """Bytes [start, start + length) of ``file`` and every CRC-32 written for them."""

    file: str
    start: int
    length: int
    crcs: tuple[int, ...]
    """Each copy of the checksum (a zip's local header or data descriptor, its central directory)."""
    where: str
    """What the bytes are, for messages: ``record 'archive/data/3' at byte 1088``."""

    @property
    def key(self) -> Key:
        """Return the span's ``Key``."""
        return (self.file, self.start)


@dataclass(frozen=True)
class Damage:
    """A written span whose bytes do not match its checksum, and the tensors it holds."""

    written: Written
    names: tuple[str, ...]
    crc: int
    """The CRC-32 of the bytes as read."""

    def message(self) -> str:
        """Return what is damaged, in words: tensors and record, not the file (errors name it)."""
        shown = " and ".join(repr(n) for n in self.names[:2])
        if len(self.names) > 2:
            shown += f" and {len(self.names) - 2} more"
        what = f"the bytes of {shown}" if self.names else "the bytes"
        return f"{what} do not match the checksum written with them ({self.written.where})"


@dataclass(frozen=True)
class Verdict:
    """What ``judge`` found: the damaged spans, and how many spans were judged whole or read in part."""

    damaged: tuple[Damage, ...]
    whole: int
    partial: int
    bytes: int
    """Bytes judged (the lengths of the spans read whole)."""


@dataclass(frozen=True)
class Seen:
    """What one process read of one written span: its spans, and the tensors it knew there."""

    written: Written
    names: tuple[str, ...]
    spans: tuple[Span, ...]


class Ledger:
    """The written spans a command may read, and what each process read of them."""

    def __init__(self) -> None:
        self._written: dict[Key, Written] = {}
        self._names: dict[Key, list[str]] = {}
        self._spans: dict[Key, list[Span]] = {}
        # Memory-mapped storages by address, each with its span's key; the storage is
        # kept, so its address cannot be given to another mapping while the ledger lives.
        self._mapped: dict[int, tuple[Key, torch.UntypedStorage]] = {}
        # ``diff`` reads its two sides in two threads, and both may read one file; the engine
        # copies and ``verify`` reads on worker threads (``engine.workers``): a span's gaps
        # and its insertion must be one step, or two threads could note a byte.
        self._lock = threading.Lock()

    def expect(self, written: Written, names: Iterable[str] = ()) -> None:
        """Add a span whose bytes may be read, and the tensors it holds."""
        with self._lock:
            self._written.setdefault(written.key, written)
            known = self._names.setdefault(written.key, [])
            known += [n for n in names if n not in known]

    def written(self, key: Key) -> Written | None:
        """Return the span at ``key``, None if none is expected there."""
        return self._written.get(key)

    def names(self, key: Key) -> tuple[str, ...]:
        """Return the tensors known to be held by the span at ``key``."""
        return tuple(self._names.get(key, ()))

    def map_storage(self, storage: torch.UntypedStorage, key: Key) -> None:
        """Say that ``storage`` (memory-mapped) holds the bytes of the span at ``key``."""
        if key in self._written and storage.nbytes():
            self._mapped[storage.data_ptr()] = (key, storage)

    def note_view(self, tensor: torch.Tensor) -> torch.Tensor:
        """Return ``tensor``, or where it views a mapped storage its bytes read from the file and noted.

        Read (``pread``), not touched through the mapping: a file cut short since it was
        mapped gives a short read, exit 3 naming it, where touching the mapping past the
        file's new end kills the process (SIGBUS) with its partial output left behind.
        A view whose bytes are not one run in memory (a transposed tensor) is not noted.
        """
        if tensor.device.type != "cpu" or not tensor.numel() or not tensor.is_contiguous():
            return tensor
        storage = tensor.untyped_storage()
        mapped = self._mapped.get(storage.data_ptr())
        if mapped is None:
            return tensor
        (file, start), _ = mapped
        offset = tensor.data_ptr() - storage.data_ptr()
        copy = torch.empty(tensor.shape, dtype=tensor.dtype)
        data = raw_bytes(copy)
        fd = open_source(file)
        try:
            what = f"the data of {self._written[(file, start)].where}"
            read_exactly(fd, data, start + offset, file, what)
        finally:
            os.close(fd)
        self.note(file, start, offset, data)
        return copy

    def note(self, file: str, start: int, offset: int, data, crc: int | None = None) -> None:
        """CRC ``data``, read at ``offset`` into the span at (``file``, ``start``), if it is one.

        Only the parts not read before are CRC'd, so the spans stay disjoint. ``crc``: the
        CRC-32 of all of ``data``, taken by the reader while the bytes were in cache; used
        as it is when none of them was read before.
        """
        written = self._written.get((file, start))
        if written is None:
            return
        if crc is None:
            # Outside the lock, so that worker threads CRC at once (isal lets go of the
            # GIL): most bytes are read once, and this CRC then serves as it is.
            crc = isal_zlib.crc32(data)
        with self._lock:
            self._note(written, offset, data, crc)

    def _note(self, written: Written, offset: int, data, crc: int | None) -> None:
        """Add the spans of ``data`` not read before to ``written``'s, with their CRC-32 (lock held)."""
        view = memoryview(data).cast("B")
        stop = min(offset + len(view), written.length)
        at = max(offset, 0)
        spans = self._spans.setdefault(written.key, [])
        if spans:
            gaps = list(_gaps(spans, at, stop))
        else:  # read for the first time, as most spans are: nothing to leave out
            gaps = [(at, stop)] if at < stop else []
        if crc is not None and gaps == [(offset, offset + len(view))]:
            _insert(spans, (offset, len(view), crc))
            return
        for gap_start, gap_stop in gaps:
            piece = view[gap_start - offset : gap_stop - offset]
            _insert(spans, (gap_start, gap_stop - gap_start, isal_zlib.crc32(piece)))

    def seen(self, files: Iterable[str] | None = None) -> list[Seen]:
        """Return what this process read, of the spans in ``files`` (every file when None)."""
        wanted = None if files is None else set(files)
        return [
            Seen(self._written[key], self.names(key), tuple(spans))
            for key, spans in self._spans.items()
            if spans and (wanted is None or key[0] in wanted)
        ]


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """Return the bytes of a contiguous CPU ``tensor``, without copying them."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _gaps(spans: list[Span], start: int, stop: int) -> Iterator[tuple[int, int]]:
    """Yield the parts of [start, stop) that no span of the sorted, disjoint ``spans`` covers."""
    at = start
    first = max(0, bisect.bisect_right(spans, (start, float("inf"), 0)) - 1)
    for offset, length, _ in spans[first:]:
        if offset >= stop:
            break
        if offset > at:
            yield at, min(offset, stop)
        at = max(at, offset + length)
    if at < stop:
        yield at, stop


def _insert(spans: list[Span], span: Span) -> None:
    """Insert ``span`` into the sorted, disjoint ``spans``.

    Neighbours are not merged: each boundary kept is one where another process's
    spans may start (``_chained``), and a record has only as many as reads touched it.
    """
    bisect.insort(spans, span)


def merged(everyone: Iterable[Iterable[Seen]]) -> list[Seen]:
    """Return what every process read, one ``Seen`` per written span, in file order."""
    everyone = [list(seen) for seen in everyone]
    if len(everyone) == 1 and len({s.written.key for s in everyone[0]}) == len(everyone[0]):
        # One process, each span once (standalone, and what ``completed`` returns): only
        # the order to set. A 64-rank save's verify has 668,372 records.
        alone = sorted(everyone[0], key=lambda s: s.written.key)
        return [Seen(s.written, s.names, tuple(sorted(s.spans))) for s in alone]
    spans: dict[Key, list[Span]] = {}
    written: dict[Key, Written] = {}
    names: dict[Key, list[str]] = {}
    for seen in everyone:
        for s in seen:
            key = s.written.key
            written.setdefault(key, s.written)
            spans.setdefault(key, []).extend(s.spans)
            known = names.setdefault(key, [])
            known += [n for n in s.names if n not in known]
    return [Seen(written[k], tuple(names[k]), tuple(sorted(spans[k]))) for k in sorted(written)]


def judge(everyone: Iterable[Iterable[Seen]]) -> Verdict:
    """Return the damaged spans among those read whole, from what every process read."""
    return verdict(merged(everyone))


def verdict(merged_seen: Iterable[Seen]) -> Verdict:
    """``judge``, of what every process read already ``merged``: one ``Seen`` per written span."""
    damaged, whole, partial, checked = [], 0, 0, 0
    for seen in merged_seen:
        written = seen.written
        crc = _reach(seen.spans).get(written.length)
        if crc is None:
            partial += 1
            continue
        whole += 1
        checked += written.length
        if any(c != crc for c in written.crcs):
            damaged.append(Damage(written, seen.names, crc))
    return Verdict(tuple(damaged), whole, partial, checked)


def next_gap(spans: Iterable[Span], length: int) -> tuple[int, int] | None:
    """Return the bytes to read so that ``spans`` chain further towards ``length``; None once they chain to it.

    From the farthest byte a chain reaches to where the next span starts (the record's
    end if none does): bytes no process read, or read only inside a span that starts
    elsewhere.
    """
    spans = sorted(spans)
    reach = _reach(spans)
    if length in reach:
        return None
    at = max(reach)
    return at, min((s[0] for s in spans if s[0] > at), default=length)


def _reach(spans: Sequence[Span]) -> dict[int, int]:
    """Return each offset a chain of spans reaches from 0, with the CRC-32 of the bytes before it.

    Spans read by different processes may overlap without sharing a boundary: a chain
    uses only spans that start where the one before it ended.
    """
    if len(spans) == 1 and spans[0][0] == 0 and spans[0][1]:
        # Read in one piece, as most records are (a million of a 1,024-rank save's).
        return {0: 0, spans[0][1]: spans[0][2]}
    reach = {0: 0}
    for offset, size, crc in sorted(spans):
        if offset in reach:
            reach.setdefault(offset + size, isal_zlib.crc32_combine(reach[offset], crc, size))
    return reach


_ACTIVE: ContextVar[Ledger | None] = ContextVar("shardckpt_ledger", default=None)


def active() -> Ledger | None:
    """Return the ledger of the command running, None when nothing is checked."""
    return _ACTIVE.get()


def checked(tensor: torch.Tensor) -> torch.Tensor:
    """Return ``tensor``, its bytes noted by the active ledger when it views a mapped record."""
    ledger = _ACTIVE.get()
    return tensor if ledger is None else ledger.note_view(tensor)


@contextmanager
def checking(always: bool = False) -> Iterator[Ledger]:
    """Yield the ledger the readers note into while inside; an outer one if a command runs inside another.

    ``always``: whatever ``SHARDCKPT_CHECKSUMS`` says (``verify``, whose work it is).
    """
    outer = _ACTIVE.get()
    if outer is not None:
        yield outer
        return
    ledger = Ledger()
    if not always and os.environ.get("SHARDCKPT_CHECKSUMS", "1") == "0":
        yield ledger  # never active: nothing is noted, nothing judged
        return
    token = _ACTIVE.set(ledger)
    try:
        yield ledger
    finally:
        _ACTIVE.reset(token)
