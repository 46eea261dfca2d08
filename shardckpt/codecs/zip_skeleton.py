"""``torch.save`` files laid out before their data exists: skeletons, and where each storage's bytes go.

``torch.save`` under ``skip_data`` writes the whole file (the real pickle, one zip
record per storage, central directory) but seeks over every storage's bytes, so a
skeleton of a state dict of fake tensors costs no memory and leaves a sparse file of
the final size. What is left is to put each storage's bytes at its record's offset
and the record's CRC-32 into the two places the zip keeps it (``regions.Record``).

Which record holds which storage: ``torch.save`` numbers storages in the order its
pickler meets them. ``storages_in_order`` pickles the same object with the same
``persistent_id`` rule to see that order, so each fake tensor's record is known, and
a real storage the object carries besides (a DTensor's device mesh holds a tensor of
ranks) is written here with its own bytes.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import struct
import tempfile
import zipfile
from collections.abc import Set
from dataclasses import dataclass
from functools import lru_cache

from shardckpt.codecs.tensor_bytes import contiguous_bytes
from shardckpt.codecs.zip_records import DATA_DESCRIPTOR, FileSlice, zip_records
from shardckpt.core.lazy_torch import torch
from shardckpt.core.torch_internals import (
    fake_tensor_mode,
    is_placeholder,
    storage_key,
    untyped_storage,
)
from shardckpt.state.regions import Piece, Record, crc32


def fake_mode():
    """Return the mode that makes placeholder tensors: shape and dtype, no memory."""
    return fake_tensor_mode()


def _skeleton_save(obj, stream, pickle_module=None) -> None:
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        if pickle_module is None:
            torch.save(obj, stream)
        else:
            torch.save(obj, stream, pickle_module=pickle_module)


Storages = list[tuple["torch.UntypedStorage", bool]]
"""A ``torch.save``'s storages in the order of its record numbers, each with whether it is a
placeholder's."""


def storages_in_order(obj, placeholders: Set[int] = frozenset()) -> Storages:
    """Return the storages ``torch.save(obj)`` records, in the order of its record numbers.

    Each comes with whether it is a placeholder's: one of ``placeholders``
    (``storage_key``s: ``unbacked`` tensors, whose bytes no one reads) or a fake tensor's,
    as ``torch.save`` itself tells them apart.
    """
    seen: dict[int, tuple[torch.UntypedStorage, bool]] = {}

    class _Recorder(pickle.Pickler):
        def persistent_id(self, value):
            if isinstance(value, torch.storage.TypedStorage):
                storage = untyped_storage(value)
            elif torch.is_storage(value):
                storage = value
            else:
                return None
            key = storage_key(storage)
            seen.setdefault(key, (storage, key in placeholders or is_placeholder(value)))
            return ("storage", len(seen))

    with torch.serialization.skip_data(materialize_fake_tensors=True):
        _Recorder(io.BytesIO(), protocol=2).dump(obj)
    return list(seen.values())


@dataclass(frozen=True)
class _Entry:
    """One data record of a ``torch.save`` zip, relative to the zip's first byte."""

    number: int
    start: int
    length: int
    crc_at: tuple[int, int]

    def placed(self, offset: int, file: str) -> Record:
        """Return this record as it lies in ``file`` with the zip starting at ``offset``."""
        return Record(
            file, offset + self.start, self.length, tuple(offset + at for at in self.crc_at)
        )


def _zip_entries(fd: int, start: int, end: int) -> dict[str, _Entry]:
    """Return every record of the zip at bytes [start, end) of ``fd`` by name (number: its order)."""
    return {
        r.name: _Entry(number, r.start, r.length, r.crc_at)
        for number, r in enumerate(zip_records(fd, start, end))
    }


def _data_records(fd: int, start: int, end: int) -> list[_Entry]:
    """Return the ``data/K`` records of the zip at bytes [start, end) of ``fd``, by K."""
    out = {
        int(r.storage_key): _Entry(int(r.storage_key), r.start, r.length, r.crc_at)
        for r in zip_records(fd, start, end)
        if r.storage_key is not None
    }
    return [out[k] for k in sorted(out)]


_MASK64 = (1 << 64) - 1


def _hash_combine(seed: int, value: int) -> int:
    """Return c10's ``hash_combine(seed, value)`` on 64-bit ``size_t``."""
    return seed ^ ((value + 0x9E3779B9 + ((seed << 6) & _MASK64) + (seed >> 2)) & _MASK64)


@dataclass(frozen=True)
class SerializationId:
    """How ``torch.save`` makes its ``.data/serialization_id``: from the CRC-32 of its records.

    ``PyTorchStreamWriter::writeSerializationId`` writes 20 digits of a hash of the
    records' names, then 20 digits of the CRC-32s of the records written before it with
    a data descriptor, combined in order (``c10::hash_combine``). Files that differ only in ``data.pkl``
    (a rank's own number) differ in the second half only.
    """

    at: int
    """Where the 40 digits lie, from the zip's first byte."""
    crcs: tuple[int, ...]
    """The CRC-32s combined, in order, as the file holds them."""
    pickle: int
    """Which of them is ``data.pkl``'s."""

    def digits(self, pickle_crc: int) -> bytes:
        """Return the id's second half for a ``data.pkl`` whose CRC-32 is ``pickle_crc``."""
        combined = 0
        for i, crc in enumerate(self.crcs):
            combined = _hash_combine(combined, pickle_crc if i == self.pickle else crc)
        return str(combined).zfill(20).encode()


def serialization_id(fd: int, start: int, end: int) -> SerializationId | None:
    """Return how the ``torch.save`` zip at [start, end) of ``fd`` made its serialization id.

    None when it has none, or when its records' CRC-32s do not give the id it holds.
    """
    with zipfile.ZipFile(io.BufferedReader(FileSlice(fd, start, end))) as zf:
        infos = zf.infolist()
    entries = _zip_entries(fd, start, end)
    found = [i for i in infos if i.filename.endswith("/.data/serialization_id")]
    pickles = [n for n, i in enumerate(infos) if i.filename.rpartition("/")[2] == "data.pkl"]
    if len(found) != 1 or len(pickles) != 1 or found[0].file_size != 40:
        return None
    # Only a record written with a data descriptor adds its CRC-32 (an empty one has none).
    written = [i for i in infos if i is not found[0] and i.flag_bits & DATA_DESCRIPTOR]
    if not any(i is infos[pickles[0]] for i in written):
        return None
    recipe = SerializationId(
        entries[found[0].filename].start + 20,
        tuple(i.CRC for i in written),
        written.index(infos[pickles[0]]),
    )
    held = os.pread(fd, 20, start + recipe.at)
    return recipe if recipe.digits(infos[pickles[0]].CRC) == held else None


def named_record(fd: int, start: int, end: int, name: str, file: str) -> Record | None:
    """Return record ``archive/{name}`` of the ``torch.save`` zip at [start, end) of ``fd``, or None."""
    for full, entry in _zip_entries(fd, start, end).items():
        head, _, tail = full.partition("/")
        if tail == name and "/" not in head:
            return entry.placed(start, file)
    return None


def pickle_record(fd: int, start: int, end: int, file: str) -> Record:
    """Return the ``data.pkl`` record of the ``torch.save`` zip at bytes [start, end) of ``fd``."""
    found = named_record(fd, start, end, "data.pkl", file)
    if found is None:
        raise RuntimeError(f"internal: no data.pkl in the torch.save zip of {file!r}")
    return found


def write_skeleton(
    fd: int,
    offset: int,
    obj,
    file: str,
    storages: Storages | None = None,
    pickle_module=None,
    placeholders: Set[int] = frozenset(),
) -> tuple[dict[int, Record], list[Record], list[Piece]]:
    """Write ``torch.save(obj)`` at ``offset`` of ``fd`` with no storage bytes; return its layout.

    Returns ``(placeholders, records, pieces)``: the ``Record`` of each fake storage (by
    the storage's ``storage_key``), every data record, and the ``Piece``s of the real
    storages written here. ``storages``: ``storages_in_order(obj)``, where the caller has it.
    ``pickle_module``: ``torch.save``'s, for an object naming another library's classes
    (``codecs.foreign_pickle``). ``placeholders``: the ``storage_key``s of real storages
    that are placeholders too (``unbacked``), left unwritten as fake ones are.
    """
    if storages is None:
        storages = storages_in_order(obj, placeholders)
    with os.fdopen(os.dup(fd), "r+b") as stream:
        stream.seek(offset)
        _skeleton_save(obj, stream, pickle_module)
        end = stream.tell()
    entries = _data_records(fd, offset, end)
    if len(entries) != len(storages) or any(
        e.length != s.nbytes() for e, (s, _) in zip(entries, storages)
    ):
        raise RuntimeError(f"internal: torch.save's records do not match the storages of {file!r}")
    placeholders: dict[int, Record] = {}
    records: list[Record] = []
    pieces: list[Piece] = []
    for entry, (storage, fake) in zip(entries, storages):
        record = entry.placed(offset, file)
        records.append(record)
        if fake:
            placeholders[storage_key(storage)] = record
            continue
        data = contiguous_bytes(torch.empty(0, dtype=torch.uint8).set_(storage))
        pwrite_all(fd, data, record.start)
        pieces.append(Piece(file, record.start, 0, len(data), crc32(data)))
    return placeholders, records, pieces


@dataclass(frozen=True)
class TensorBlob:
    """``torch.save`` of one tensor of a shape and dtype, as DCP stores each item: bytes around the data."""

    head: bytes
    """Everything before the data (local headers, pickle), with the data's local header last."""
    data: _Entry
    """The data record, from the blob's first byte."""
    tail: bytes
    """Everything after the data (other records, central directory)."""

    @property
    def size(self) -> int:
        return len(self.head) + self.data.length + len(self.tail)


def unbacked(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Return a CPU tensor of ``shape`` and ``dtype`` whose bytes no one will read: a shared map of a sparse file.

    ``torch.save`` under ``skip_data`` pickles it as it pickles a fake tensor (location
    ``cpu``, the storage's size) and never touches its pages, so it takes no memory and
    no commit charge; unlike a ``FakeTensorMode``, whose first use imports torch's
    compiler stack (``torch._dynamo``, triton where installed: over a second and 100 MiB
    of memory), it needs nothing but the file.
    """
    count = math.prod(shape)
    if not count:
        return torch.empty(shape, dtype=dtype)
    with tempfile.TemporaryFile() as f:
        f.truncate(count * dtype.itemsize)
        flat = torch.from_file(f"/proc/self/fd/{f.fileno()}", shared=True, size=count, dtype=dtype)
    return flat.view(shape)


@lru_cache(maxsize=4096)
def tensor_blob(shape: tuple[int, ...], dtype: torch.dtype) -> TensorBlob:
    """Return the blob layout ``torch.save`` gives a contiguous tensor of ``shape`` and ``dtype``."""
    placeholder = unbacked(shape, dtype)
    with tempfile.TemporaryFile() as f:
        _skeleton_save(placeholder, f)
        end = f.tell()
        fd = f.fileno()
        (entry,) = _data_records(fd, 0, end)
        head = os.pread(fd, entry.start, 0)
        tail = os.pread(fd, end - entry.start - entry.length, entry.start + entry.length)
    return TensorBlob(head, entry, tail)


def write_blob(fd: int, offset: int, blob: TensorBlob, file: str) -> Record:
    """Write ``blob`` at ``offset`` of ``fd`` without its data; return the data's record."""
    pwrite_all(fd, memoryview(blob.head), offset)
    pwrite_all(fd, memoryview(blob.tail), offset + blob.data.start + blob.data.length)
    return blob.data.placed(offset, file)


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset`` of ``fd`` (``os.pwrite`` may write less)."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def patch_crc(fd: int, record: Record, crc: int) -> None:
    """Write ``crc`` into ``record``'s CRC-32 fields (as hex digits for a text field)."""
    packed = b"%08x" % crc if record.as_text else struct.pack("<I", crc)
    for at in record.crc_at:
        pwrite_all(fd, memoryview(packed), at)


__all__ = [
    "FileSlice",
    "TensorBlob",
    "pwrite_all",
    "fake_mode",
    "patch_crc",
    "SerializationId",
    "named_record",
    "pickle_record",
    "serialization_id",
    "storages_in_order",
    "tensor_blob",
    "write_blob",
    "write_skeleton",
]
