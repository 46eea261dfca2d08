"""``torch.save`` files of a directory on a URL (per-rank files) read where they lie.

The readers of per-rank files (``fsdp2-ranks``, ``fsdp1-sharded``, ``fsdp1-local``) keep
each file's loaded object and take views of its tensors (a DTensor's local shard, a
ShardedTensor's shards, rows of them). A local file is memory-mapped, so a view costs
nothing until it is read. The stand-in of a URL SRC's object (``core.files.is_remote_file``)
must never be mapped (a mapping reads zeros): ``load_in_place`` loads it on the meta
device instead, which says where each storage's zip record lies, and ``values`` reads a
view's elements from there by ranged reads (``core.files``), each checked against its
record's CRC-32 as the mapped file's are (``state.checksums``). So a rank reads the
pickles of every file and only the rows it copies.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from shardckpt.core.files import is_remote_file
from shardckpt.core.lazy_torch import torch
from shardckpt.core.torch_internals import stored_offset
from shardckpt.formats.torch_save.file import is_torch_zip, load, load_dict
from shardckpt.formats.torch_save.mapped import (
    MappedRecord,
    local_tensors,
    read_record_into,
    record_view,
    stored_records,
)
from shardckpt.state.checksums import active, checked, raw_bytes
from shardckpt.state.tree import walk

_FILE = "_shardckpt_records"
"""The attribute of a storage loaded on the meta device naming its file and records.

torch keeps one Python object per storage (and reads ``_checkpoint_offset`` from it the
same way), so every view of it finds them."""


def load_in_place(path: Path, trust_pickle: bool, **options) -> dict:
    """Return ``load_dict(path, trust_pickle, **options)``: a URL SRC's ``torch.save`` zip on the meta device.

    Each storage of such a file is tagged with its file and record, for ``values``. A
    file whose storages cannot all be placed (the other byte order, a torch that does
    not say where they lie) or a legacy (not zip) file is loaded whole into memory
    through a stream, as ``load`` does.
    """
    return _in_place(load_dict, path, trust_pickle, options)


def load_object_in_place(path: Path, trust_pickle: bool, **options) -> object:
    """Return ``load(path, trust_pickle, **options)`` as ``load_in_place`` does: any top level (a bare tensor too)."""
    return _in_place(load, path, trust_pickle, options)


def _in_place(loader: Callable[..., object], path: Path, trust_pickle: bool, options: dict):
    if not (is_remote_file(path) and is_torch_zip(path)):
        return loader(path, trust_pickle, **options)
    obj = loader(path, trust_pickle, lazy=True, **options)
    records = stored_records(path, obj)
    storages = [
        t.untyped_storage()
        for _, leaf in walk(obj)
        for t in local_tensors(leaf)
        if t.untyped_storage().nbytes()
    ]
    if not all(stored_offset(s) in records for s in storages):
        return loader(path, trust_pickle, **options)
    if (ledger := active()) is not None:
        for record in records.values():
            ledger.expect(record.written, record.names)
    for storage in storages:
        setattr(storage, _FILE, (path, records))
    return obj


def values(t: torch.Tensor) -> torch.Tensor:
    """Return the values of ``t`` (a tensor of a loaded file, or a view of one), their bytes checked.

    A mapped file's view is returned as it is (``checked`` notes its bytes); a view of a
    storage ``load_in_place`` left on the meta device is read from its record.
    """
    if t.device.type != "meta":
        return checked(t)
    if not t.numel():  # an empty storage has no record
        return torch.empty(t.shape, dtype=t.dtype)
    path, records = getattr(t.untyped_storage(), _FILE)
    record: MappedRecord = records[stored_offset(t.untyped_storage())]
    size = t.element_size()
    if t.is_contiguous():
        out = torch.empty(t.shape, dtype=t.dtype)
        if out.numel():
            read_record_into(
                path, raw_bytes(out), record.written.start + t.storage_offset() * size, record
            )
        return out
    return record_view(path, t, record)  # a view that is not one run of its record
