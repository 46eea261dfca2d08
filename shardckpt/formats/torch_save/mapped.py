"""Which zip record of a memory-mapped ``torch.save`` file each loaded tensor's bytes lie in.

``torch.load(mmap=True)`` maps the file once and gives each storage the slice of the
map at its record's data, so storage addresses keep the file's offsets apart by the
same amounts: one storage matched to its record places them all. Each record then goes
to the command's ledger (``state.checksums``) with the CRC-32 the zip holds for it and
the tensors viewing it, so the bytes a reader takes from a storage are checked against
the checksum ``torch.load`` never reads.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from shardckpt.codecs.pickle_scan import DamagedZip
from shardckpt.codecs.zip_records import ZipRecord, zip_records
from shardckpt.core.files import open_source, pread, read_exactly
from shardckpt.core.lazy_torch import torch
from shardckpt.core.torch_internals import stored_offset
from shardckpt.state.checksums import Written, active, raw_bytes
from shardckpt.state.tree import dotted, walk

_CANDIDATES = 8
"""Records tried for the first storage: the first whose length fits places all the others."""


@dataclass
class _Mapped:
    """A memory-mapped storage and the tensors viewing it."""

    storage: torch.UntypedStorage
    names: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class MappedRecord:
    """The zip record a memory-mapped storage's bytes lie in, and the tensors viewing it."""

    written: Written
    names: tuple[str, ...]


def expect_mapped(path: Path, obj: object) -> None:
    """Tell the active ledger the record, CRC-32 and tensors of each memory-mapped storage of ``obj``.

    ``obj`` is what ``torch.load(path, mmap=True)`` returned. Storages it cannot place
    (a file in the other byte order, whose bytes torch swapped in memory) are left
    unchecked here; ``shardckpt verify`` reads the file's records themselves.
    """
    ledger = active()
    if ledger is None:
        return
    for storage, record in _placed(path, obj).values():
        ledger.expect(record.written, record.names)
        ledger.map_storage(storage, record.written.key)


def mapped_records(path: Path, obj: object) -> dict[int, MappedRecord]:
    """Return the record of each memory-mapped storage of ``obj`` (``torch.load``'s of ``path``), by address.

    Empty where they cannot be placed (a file in the other byte order, one torch could
    not map): its tensors are then read through the mapping, as ``expect_mapped`` says.
    """
    return {ptr: record for ptr, (_, record) in _placed(path, obj).items()}


def stored_records(path: Path, obj: object) -> dict[int, MappedRecord]:
    """Return the record of each storage of ``obj`` (``torch.load``'s of ``path`` on the meta device), by its offset in ``path``.

    torch's loader says where each storage lies (``torch_internals.stored_offset``); a
    storage no record starts at (or that torch did not place) is left out, as is every
    one of a file in the other byte order: the caller then reads the file another way.
    """
    names: dict[int, list[str]] = {}
    for path_, leaf in walk(obj):
        for tensor in local_tensors(leaf):
            at = stored_offset(tensor.untyped_storage())
            if at is not None and tensor.untyped_storage().nbytes():
                names.setdefault(at, []).append(dotted(path_))
    records = _readable_records(path) if names else None
    by_start = {r.start: r for r in records or ()}
    return {
        at: MappedRecord(record_written(path, by_start[at]), tuple(held))
        for at, held in names.items()
        if at in by_start
    }


def _placed(path: Path, obj: object) -> dict[int, tuple[torch.UntypedStorage, MappedRecord]]:
    """Return each memory-mapped storage of ``obj`` that could be placed, with its record, by address."""
    try:
        storages = _storages(obj)
    except RecursionError:
        return {}
    records = _readable_records(path) if storages else None
    if records is None:
        return {}
    placed = _place(storages, records)
    return {
        ptr: (mapped.storage, MappedRecord(record_written(path, placed[ptr]), tuple(mapped.names)))
        for ptr, mapped in storages.items()
        if placed.get(ptr) is not None
    }


def record_written(path: Path, record: ZipRecord) -> Written:
    """Return a storage's zip record as the span of ``path`` whose bytes are checked against its CRC-32."""
    where = f"record '{record.name}' at byte {record.start}"
    return Written(str(path), record.start, record.length, record.crcs, where)


def _readable_records(path: Path) -> list[ZipRecord] | None:
    """Return ``_records(path)``; None also where the zip does not read (its tensors are then read unchecked here)."""
    try:
        return _records(path)
    except (OSError, DamagedZip):
        return None


def _storages(obj: object) -> dict[int, _Mapped]:
    """Return the CPU storages the tensors of ``obj`` view, by address, with the tensors and their bytes."""
    out: dict[int, _Mapped] = {}
    for path, leaf in walk(obj):
        for tensor in local_tensors(leaf):
            storage = tensor.untyped_storage()
            if tensor.device.type != "cpu" or not storage.nbytes():
                continue
            out.setdefault(storage.data_ptr(), _Mapped(storage)).names.append(dotted(path))
    return out


def local_tensors(leaf: object) -> list[torch.Tensor]:
    """Return the plain tensors a leaf holds: itself, a DTensor's local shard, a ShardedTensor's shards."""
    shards = getattr(leaf, "local_shards", None)
    if isinstance(shards, list):
        return [s.tensor for s in shards if isinstance(getattr(s, "tensor", None), torch.Tensor)]
    local = getattr(leaf, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        return [local]
    return [leaf] if type(leaf) in (torch.Tensor, torch.nn.Parameter) else []


def _records(path: Path) -> list[ZipRecord] | None:
    """Return the storage records of the zip at ``path``, by offset; None when torch swapped its bytes."""
    fd = open_source(path)  # a URL SRC's stand-in reads from the store (pread)
    try:
        records = zip_records(fd, 0, os.fstat(fd).st_size, central=False)
        order = [r for r in records if r.name.rsplit("/", 1)[-1] == "byteorder"]
        if order and pread(fd, order[0].length, order[0].start).decode() != sys.byteorder:
            return None
    finally:
        os.close(fd)
    return sorted((r for r in records if r.storage_key is not None and r.length), key=_start)


def _start(record: ZipRecord) -> int:
    return record.start


def _place(storages: dict[int, _Mapped], records: list[ZipRecord]) -> dict[int, ZipRecord]:
    """Return the record of each storage address, once one offset between map and file fits them all."""
    by_start = {r.start: r for r in records}
    first = min(storages)
    size = storages[first].storage.nbytes()
    for record in [r for r in records if r.length == size][:_CANDIDATES]:
        base = first - record.start
        placed = {ptr: by_start.get(ptr - base) for ptr in storages}
        if all(
            r is not None and r.length == storages[p].storage.nbytes() for p, r in placed.items()
        ):
            return placed  # type: ignore[return-value]
    return {}


def read_record_into(path: Path, data, at: int, record: MappedRecord) -> None:
    """Fill ``data`` from byte ``at`` of ``path`` (inside ``record``) and note it in the active ledger."""
    fd = open_source(path)
    try:
        read_exactly(fd, data, at, path, f"the data of {record.written.where}")
    finally:
        os.close(fd)
    if (ledger := active()) is not None:
        ledger.expect(record.written, record.names)
        ledger.note(*record.written.key, at - record.written.start, data)


def record_view(path: Path, t: torch.Tensor, record: MappedRecord) -> torch.Tensor:
    """Return view ``t`` of ``record``'s storage, the record read whole (a view that is not one run of it)."""
    data = torch.empty(record.written.length, dtype=torch.uint8)
    read_record_into(path, raw_bytes(data), record.written.start, record)
    whole = torch.empty(0, dtype=t.dtype)
    return whole.set_(data.untyped_storage(), t.storage_offset(), t.shape, t.stride())
