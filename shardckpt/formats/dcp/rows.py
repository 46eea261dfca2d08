"""Rows of a DCP tensor read straight from the bytes of its stored chunks.

``FileSystemWriter`` stores each chunk of a tensor as a ``torch.save`` zip inside a
``.distcp`` file (``storage_data``: file, offset, length). DCP's own loader
``torch.load``s a chunk's whole zip whatever part of it is wanted, so a batch of rows
of a big chunk would cost the whole chunk in memory, and reading it again for every
batch. Here torch's loader itself, with ``map_location="meta"``, tells where the
chunk's storage lies in the zip (``torch_internals.stored_offset``) and the stored tensor's
shape, dtype and strides, without reading its data; the wanted rows are then read
into the target with ``preadv``, and nothing else is read.

Where a run of rows lies whole in chunks that span every column, ``runs`` says where,
and the engine maps those bytes instead of reading them into a buffer
(``engine.stored_copy``).

A chunk this cannot place (an extension transformed its bytes, or the stored tensor is
not laid out row after row, or in the other byte order, or torch's loader does not say
where it lies) is left to DCP's loader (``DcpReader``).
"""

from __future__ import annotations

import io
import math
import os
import sys
import weakref
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from isal import isal_zlib

from shardckpt.codecs.pickle_bounds import check_torch_zip
from shardckpt.codecs.pickle_scan import first_line
from shardckpt.codecs.torch_pickle import NotPlain, plain_pickle
from shardckpt.codecs.zip_layout import ZipLayout, ZipLayouts, chunk_own
from shardckpt.codecs.zip_records import HELD, FileSlice, ZipRecord, records_of, storage_key
from shardckpt.core import lazy_torch
from shardckpt.core.errors import BadInputError, ShardckptError
from shardckpt.core.files import (
    OutOfDescriptors,
    kept_open,
    open_source,
    os_error,
    preadv,
    will_read,
)
from shardckpt.core.lazy_torch import torch
from shardckpt.formats.base import StoredRun
from shardckpt.formats.dcp.plain_metadata import MetadataIndex
from shardckpt.state.checksums import Written, active
from shardckpt.state.plain_tensor import PlainTensor

_RECOPY = "the file is damaged or does not match .metadata; re-copy it from where the checkpoint was written"
_READ = 4 << 20
"""Bytes read at a time: few enough to be CRC'd from the CPU's cache as they arrive."""


@dataclass(frozen=True)
class Placed:
    """Where the elements of one stored chunk lie, row after row, in its data file."""

    file: str
    start: int
    """Byte offset of the chunk's first element in ``file``."""
    written: Written | None = None
    """The zip record holding the elements and the CRC-32 written for it; None where none is."""


@dataclass(frozen=True)
class _Loaded:
    """What ``torch.load`` on the meta device says of a chunk's pickle: alike for every chunk that pickles alike.

    The chunks of one save repeat a few pickles (one per shape and dtype) thousands of
    times, each zip with its own bytes and serialization id; torch's loader is asked once
    per pickle, and where each chunk's storage lies is then its own zip's record of the
    name torch's loader placed the first one's at.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    contiguous: bool
    storage_offset: int
    """In elements, from the storage's first byte."""
    element_size: int
    numel: int
    record: str
    """The name of the zip record that holds the storage."""


class StoredRows:
    """Reads rows of DCP tensors from their chunks' bytes (``read_into``); remembers where chunks lie."""

    def __init__(self, src: Path, metadata):
        self.src = src
        self.metadata = metadata
        self._placed: dict[tuple[str, tuple[int, ...]], Placed | None] = {}
        self._loaded: dict[tuple, _Loaded] = {}
        self._kinds = ZipLayouts()
        self._files = _OpenFiles(src)

    def runs(
        self, key: str, dtype: torch.dtype, shape: tuple[int, ...], start: int, stop: int
    ) -> list[StoredRun] | None:
        """Return where elements [start, stop) of tensor ``key`` lie, in order, one run per chunk.

        None when a chunk they overlap does not span every column (its rows are not one
        run in the file), cannot be placed, or runs past its file's end (mapping it would
        fault; ``read_into`` reads it and says it is truncated).
        """
        entry = self.metadata.state_dict_metadata[key]
        row = math.prod(shape[1:]) if shape else 1
        self._ends_ahead(key, start // row, -(-stop // row))
        size = dtype.itemsize
        out: list[StoredRun] = []
        at = start
        for chunk in sorted(entry.chunks, key=lambda c: tuple(c.offsets)):
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            if 0 in sizes:
                continue
            if sizes[1:] != tuple(shape[1:]):
                return None
            first = offsets[0] * row if sizes else 0
            lo, hi = max(at, first), min(stop, first + math.prod(sizes))
            if lo >= hi:
                continue
            placed = self._place(key, offsets, sizes, dtype)
            if lo != at or placed is None:
                return None
            offset = placed.start + (lo - first) * size
            if offset + (hi - lo) * size > self._size(placed.file):
                return None
            path = self._files.path(placed.file)
            out.append(StoredRun(path, offset, (hi - lo) * size, placed.written))
            at = hi
        return out if at == stop else None

    def _size(self, file: str) -> int:
        # Asked each time, not remembered: a file cut short since the last run is not mapped.
        path = self._files.path(file)
        try:
            return os.stat(path).st_size
        except OSError as exc:
            raise os_error(exc, path) from None

    def read_into(self, key: str, target: torch.Tensor, first_row: int) -> bool:
        """Fill ``target`` (rows ``first_row``.. of tensor ``key``) from the stored chunks.

        Returns False, having read nothing, when a chunk it overlaps cannot be placed.
        The chunks of a tensor tile it exactly (``dcp_check``), so every element of
        ``target`` is written.
        """
        entry = self.metadata.state_dict_metadata[key]
        stop = first_row + (target.shape[0] if target.dim() else 1)
        self._ends_ahead(key, first_row, stop)
        parts = []
        for chunk in entry.chunks:
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            lo, hi = (
                (max(first_row, offsets[0]), min(stop, offsets[0] + sizes[0])) if sizes else (0, 1)
            )
            if lo >= hi or 0 in sizes:
                continue
            placed = self._place(key, offsets, sizes, target.dtype)
            if placed is None:
                return False
            parts.append((placed, offsets, sizes, lo, hi))
        ledger = active()
        by_file: dict[str, list[tuple]] = {}
        for part in parts:
            by_file.setdefault(part[0].file, []).append(part)
        # One file open at a time: a tensor split over a 1,024-rank save's files must not
        # hold 1,024 descriptors at once (``ulimit -n`` is often 1,024, or lower).
        size = target.element_size()
        for file, in_file in by_file.items():
            will_read(self._files.path(file), [_span(part, size) for part in in_file])
        for file, in_file in by_file.items():
            with self._files.opened(file) as fd:
                for placed, offsets, sizes, lo, hi in in_file:
                    at = _span((placed, offsets, sizes, lo, hi), size)[0]
                    dest = _window(target, offsets, sizes, lo - first_row, hi - first_row)
                    check = ledger is not None and placed.written is not None
                    read, crc = self._read(fd, dest, at, key, file, check)
                    if check:
                        ledger.expect(placed.written, [key])
                        ledger.note(*placed.written.key, at - placed.written.start, read, crc)
        return True

    def _read(
        self, fd: int, dest: torch.Tensor, at: int, key: str, file: str, crc: bool
    ) -> tuple[memoryview, int | None]:
        """Read ``dest``'s bytes from byte ``at`` of ``fd`` (through a buffer if ``dest`` is strided).

        Returns them, and with ``crc`` their CRC-32, taken ``_READ`` bytes at a time as each
        arrives, while it is still in the CPU's cache: no second pass over the bytes.
        """
        buffer = dest if dest.is_contiguous() else torch.empty(dest.shape, dtype=dest.dtype)
        view = memoryview(buffer.reshape(-1).view(torch.uint8).numpy())
        done, total = 0, 0 if crc else None
        while done < len(view):
            try:
                n = preadv(fd, view[done : done + _READ], at + done)
            except OSError as exc:
                raise os_error(exc, self.src / file) from None
            if n == 0:
                raise BadInputError(
                    f"truncated: the data of {key!r} ends at byte {at + done}, "
                    f"{len(view) - done} bytes short",
                    path=self.src / file,
                    hint=_RECOPY,
                )
            if total is not None:
                total = isal_zlib.crc32_combine(total, isal_zlib.crc32(view[done : done + n]), n)
            done += n
        if buffer is not dest:
            dest.copy_(buffer)
        return view, total

    def _ends_ahead(self, key: str, first_row: int, stop: int) -> None:
        """Say that the zips of tensor ``key``'s chunks over rows [first_row, stop) not placed yet are read next.

        Placing a chunk reads its zip's first and last ``HELD`` bytes (``FileSlice``): a
        URL SRC's are fetched ahead, side by side, instead of one after another.
        """
        by_file: dict[str, list[tuple[int, int]]] = {}
        for chunk in self.metadata.state_dict_metadata[key].chunks:
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            if (key, offsets) in self._placed or 0 in sizes:
                continue
            if sizes and not (offsets[0] < stop and first_row < offsets[0] + sizes[0]):
                continue
            info = self.metadata.storage_data[MetadataIndex(key, offsets)]
            if info.transform_descriptors:
                continue
            at, length = info.offset, info.length
            ends = (
                [(at, length)] if length <= 2 * HELD else [(at, HELD), (at + length - HELD, HELD)]
            )
            by_file.setdefault(info.relative_path, []).extend(ends)
        for file, ranges in by_file.items():
            will_read(self._files.path(file), ranges)

    def _place(
        self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...], dtype: torch.dtype
    ) -> Placed | None:
        if (key, offsets) not in self._placed:
            info = self.metadata.storage_data[MetadataIndex(key, offsets)]
            self._placed[(key, offsets)] = self.locate(info, key, offsets, sizes, dtype)
        return self._placed[(key, offsets)]

    def locate(
        self, info, key: str, offsets: tuple, sizes: tuple, dtype: torch.dtype
    ) -> Placed | None:
        """Return where the chunk ``info`` stores lies, row by row; None leaves it to DCP's loader.

        Here a chunk is a ``torch.save`` of it, which torch's loader places; a variant
        that stores chunks otherwise (raw safetensors data) places them itself.
        """
        if info.transform_descriptors:
            return None
        file = info.relative_path
        with self._files.opened(file) as fd:
            path = self._files.path(file)
            return _locate(fd, path, info, key, offsets, sizes, dtype, self._loaded, self._kinds)


@dataclass(frozen=True)
class _Kind:
    """What a chunk's zip says, read by the zip reader; later chunks of its size may repeat it byte for byte."""

    records: list[ZipRecord]
    order: str
    """Its byteorder record, "little" where it has none (as torch's loader takes it)."""
    seen: tuple | None
    """Its pickle, byteorder and version: the key of ``_Loaded``; None unless one ``data.pkl``."""
    layout: ZipLayout | None
    """Its bytes that a chunk of its kind repeats; None where no other chunk is compared with it."""


def _read_kind(zip_file: FileSlice, length: int, path: Path) -> _Kind:
    """Read the zip of a chunk (``length`` bytes) with the zip reader; check its pickle first."""
    buffered = io.BufferedReader(zip_file)
    try:
        with zipfile.ZipFile(buffered) as zf:
            pickles = check_torch_zip(zf, length, path)
            names = zf.namelist()
            orders = [n for n in names if n.rsplit("/", 1)[-1] == "byteorder"]
            order = zf.read(orders[0]).decode() if orders else "little"
            records = records_of(zip_file, zf)
            # What torch's loader reads besides the storages: data.pkl (taken by name
            # whatever its case: one such record alone), byteorder and the version.
            versions = [zf.read(n) for n in names if n.rsplit("/", 1)[-1] == "version"]
            layout = ZipLayout.of(zip_file, length, zf, records, chunk_own)
    finally:
        buffered.detach()  # the buffer goes; zip_file stays open for the caller
    seen = (pickles[0], order, *versions) if len(pickles) == 1 else None
    return _Kind(records, order, seen, layout)


def _locate(
    fd: int,
    path: Path,
    info,
    key: str,
    offsets: tuple,
    sizes: tuple,
    dtype: torch.dtype,
    loaded: dict[tuple, _Loaded],
    kinds: ZipLayouts,
) -> Placed | None:
    """Return where the chunk that ``info`` (its ``storage_data`` entry) holds lies, row by row.

    ``fd``: its file (``path``), open. None when it is not laid out row after row in this
    machine's byte order, or when torch's loader does not say where its storage lies.
    ``loaded``: what torch's loader said of each pickle seen before, with its byteorder
    and version (``_Loaded``); ``kinds``: the last zips read whole, each with its
    ``_Kind``; both filled here.
    """
    file, offset, length = info.relative_path, info.offset, info.length
    try:
        # Its directory, headers and pickle are read in one or two reads (HELD).
        zip_file = FileSlice(fd, offset, offset + length, held=HELD)
        repeated = kinds.find(zip_file, length)
        if repeated is not None:
            records, kind = repeated
        else:
            kind = _read_kind(zip_file, length, path)
            records = kind.records
            if kind.layout is not None:
                kinds.add(kind.layout, kind)
        order, seen = kind.order, kind.seen
        # The storage's record, whose CRC-32 its bytes are checked against as read.
        records = [r for r in records if storage_key(r.name)]
        said = loaded.get(seen) if seen is not None else None
        held = _named(records, said)
        if held is None:
            stored = said = _said_plainly(seen, records) if not lazy_torch.loaded() else None
            if said is None:
                zip_file.seek(0)
                chunk = io.BufferedReader(zip_file)
                stored = torch.load(chunk, map_location="meta", weights_only=True)
                said = _said(stored, records)
            if said is not None and seen is not None:
                loaded[seen] = said
            held = _named(records, said)
        else:
            stored = said
    except OSError as exc:
        raise os_error(exc, path) from None
    except ShardckptError:
        raise
    except Exception as exc:
        raise BadInputError(
            f"cannot read the chunk at {list(offsets)} of {key!r} ({first_line(exc)})",
            path=path,
            hint=_RECOPY,
        ) from None
    # By name: the chunk's dtype may be torch's and .metadata's a stand-in (``state.dtypes``),
    # where torch was imported for a chunk the stand-ins do not read.
    if said is None or said.shape != tuple(sizes) or str(said.dtype) != str(dtype):
        what = (
            f"a {tuple(stored.shape)} {stored.dtype} tensor"
            if isinstance(stored, _Loaded) or lazy_torch.is_tensor(stored)
            else type(stored).__name__
        )
        raise BadInputError(
            f"the chunk at {list(offsets)} of {key!r} is stored as {what}, where .metadata "
            f"says {tuple(sizes)} {dtype}",
            path=path,
            hint=_RECOPY,
        )
    if order != sys.byteorder or not said.contiguous or held is None:
        return None
    start = held.start + said.storage_offset * said.element_size
    if start + said.numel * said.element_size > length:
        raise BadInputError(
            f"the chunk at {list(offsets)} of {key!r} runs past its {length} stored bytes",
            path=path,
            hint=_RECOPY,
        )
    return Placed(file, offset + start, _written(path, offset, held))


def _said(stored: object, records: list[ZipRecord]) -> _Loaded | None:
    """Return what torch's loader said of a chunk (``_Loaded``); None when it loaded no tensor.

    ``record`` is "" where torch does not say where the storage lies, or no storage
    record of the zip starts there.
    """
    if not isinstance(stored, torch.Tensor):
        return None
    from shardckpt.core.torch_internals import stored_offset

    at = stored_offset(stored.untyped_storage())
    name = next((r.name for r in records if r.start == at), "") if at is not None else ""
    return _Loaded(
        tuple(stored.shape),
        stored.dtype,
        stored.is_contiguous(),
        stored.storage_offset(),
        stored.element_size(),
        stored.numel(),
        name,
    )


def _said_plainly(seen: tuple | None, records: list[ZipRecord]) -> _Loaded | None:
    """Return what torch's loader would say of a chunk, read without torch (``codecs.torch_pickle``).

    ``seen``: the chunk's pickle, byte order and version; ``records``: its storage
    records. None where the stand-ins do not read that pickle as one whole tensor: torch's
    loader is asked then.
    """
    if seen is None or seen[1:] != (sys.byteorder, b"3\n"):
        return None
    by_key = {key: r for r in records if (key := storage_key(r.name)) is not None}
    try:
        tensor = plain_pickle(seen[0], by_key)
    except NotPlain:
        return None
    if not isinstance(tensor, PlainTensor):
        return None
    return _Loaded(
        tensor.shape,
        tensor.dtype,
        tensor.is_contiguous(),
        tensor.storage_offset,
        tensor.dtype.itemsize,
        tensor.numel(),
        by_key[tensor.storage].name,
    )


def _named(records: list[ZipRecord], said: _Loaded | None) -> ZipRecord | None:
    """Return the storage record ``said`` names among a chunk's ``records``; None where there is none."""
    if said is None or not said.record:
        return None
    return next((r for r in records if r.name == said.record), None)


def _written(path: Path, offset: int, stored: ZipRecord) -> Written:
    """Return the storage record ``stored`` of a chunk's zip (at ``offset`` of ``path``) as checked bytes."""
    where = f"record '{stored.name}' at byte {offset + stored.start}"
    return Written(str(path), offset + stored.start, stored.length, stored.crcs, where)


def _span(part: tuple, element_size: int) -> tuple[int, int]:
    """Return where rows ``lo``..``hi`` of a placed chunk lie in its file: (first byte, length)."""
    placed, offsets, sizes, lo, hi = part
    if not sizes:
        return placed.start, element_size
    row_bytes = math.prod(sizes[1:]) * element_size
    return placed.start + (lo - offsets[0]) * row_bytes, (hi - lo) * row_bytes


def _window(target: torch.Tensor, offsets: tuple, sizes: tuple, lo: int, hi: int) -> torch.Tensor:
    """Return the part of ``target`` (rows ``lo``..``hi``) that a chunk at ``offsets`` fills."""
    if not sizes:
        return target
    dest = target[lo:hi]
    for dim in range(1, len(sizes)):
        dest = dest.narrow(dim, offsets[dim], sizes[dim])
    return dest


class _OpenFiles:
    """SRC's data files, the first ``kept_open()`` opened kept open for every chunk after, the others opened per use.

    A 64-rank save has 94,700 chunks in 64 files, and a 1,024-rank one 1.16 million in
    1,024; opening and closing a file per chunk cost about a third of placing one. A
    tensor's chunks lie in every file in turn, where evicting the least recently used
    file would reopen every one; so the first files stay, and a file past the limit is
    opened for its use alone. Kept files close with the reader.
    """

    def __init__(self, src: Path):
        self.src = src
        self._paths: dict[str, Path] = {}
        self._fds: dict[str, int] = {}
        self._limit = kept_open()
        weakref.finalize(self, _close_all, self._fds)

    def path(self, file: str) -> Path:
        """Return the path of ``file``, relative to SRC."""
        if file not in self._paths:
            self._paths[file] = self.src / file
        return self._paths[file]

    @contextmanager
    def opened(self, file: str) -> Iterator[int]:
        """Yield a descriptor of ``file`` open for reading."""
        fd = self._fds.get(file)
        if fd is not None:
            yield fd
            return
        fd = self._open(file)
        if len(self._fds) < self._limit:
            self._fds[file] = fd
            yield fd
            return
        try:
            yield fd
        finally:
            os.close(fd)

    def _open(self, file: str) -> int:
        """Return a new descriptor of ``file``; the kept ones are given up first when none is left."""
        try:
            return open_source(self.path(file))
        except OutOfDescriptors:
            if not self._fds:
                raise
        # Other files hold the rest of the limit (a writer's, torch's): reading one file
        # at a time is slower, never a failed run.
        self._limit = 0
        _close_all(self._fds)
        return open_source(self.path(file))


def _close_all(fds: dict[str, int]) -> None:
    for fd in fds.values():
        os.close(fd)
    fds.clear()
