"""What ``shardckpt verify`` checks in each file of a checkpoint, worked out before its data is read.

A file's layout tells which of its bytes carry a checksum and what must add up:

- a ``torch.save`` zip: every record, against the CRC-32 in its local header (or data
  descriptor) and central directory;
- a DCP data file: the items ``.metadata`` stores in it must account for every byte,
  and each item is a ``torch.save`` zip checked as above;
- a safetensors file: the tensors' data must fill the file after the header exactly,
  and a file shardckpt wrote has each tensor's CRC-32 in its header (``hf.digests``);
- anything else (``.metadata``, JSON) has no checksum; its bytes are read all the same.

What a layout shows wrong without reading data is a problem of the file; the spans
are checked as the bytes are read (``engine.scan``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from shardckpt.codecs.pickle_scan import DamagedZip
from shardckpt.codecs.zip_layout import ZipLayouts, chunk_own, read_layout
from shardckpt.codecs.zip_records import HELD, FileSlice, zip_records
from shardckpt.core.errors import BadInputError
from shardckpt.core.files import open_source, os_error, read_head, source_tree
from shardckpt.formats.base import Index, Reader, StoredItem
from shardckpt.formats.hf.digests import header, read_digests
from shardckpt.formats.hf.safetensors_file import is_safetensors_file
from shardckpt.state.checksums import Ledger, Written

_ZIP_MAGIC = b"PK\x03\x04"


@dataclass(frozen=True)
class FileCheck:
    """One file of a checkpoint: its size, its spans that carry a checksum, and what is wrong with its layout."""

    path: str
    size: int
    spans: tuple[Written, ...] = ()
    """In file order, disjoint."""
    names: tuple[tuple[str, ...], ...] = ()
    """The tensors each span holds (none for a zip's pickle or version record)."""
    problems: tuple[str, ...] = ()
    """What the layout shows wrong, in words (``bytes 10..20 belong to no item of .metadata``)."""


def file_checks(reader: Reader, index: Index, ledger: Ledger) -> list[FileCheck]:
    """Return what to check in each file of the checkpoint ``reader`` opened as ``index``.

    ``ledger`` knows the tensors in each record of the ``torch.save`` files the reader
    loaded (``torch_save.mapped``); they name the damage.
    """
    items = reader.stored_items()
    files = checkpoint_files(reader, index)
    return [_check(path, items.get(name), ledger) for path, name in files]


def checkpoint_files(reader: Reader, index: Index) -> list[tuple[Path, str]]:
    """Return every file of the checkpoint, read or carried, with its name relative to SRC, in name order.

    A source that does not list its files (``members()`` of a directory is SRC itself)
    is every file in it. A name listed that is not there (``.metadata`` of torch's HF
    storage shards, which have none) is no file of it: the reader, which opened every
    file it needs, would have said so.
    """
    carried = {p.file for p in index.parts if p.key is None}
    names = sorted({n for n in reader.members() if n} | carried)
    if not names:
        names = [""]
    out: list[tuple[Path, str]] = []
    for name in names:
        path = reader.src / name if name else reader.src
        if not os.path.lexists(path):
            continue
        if path.is_dir():
            inside = source_tree(path, reader.src)
            out += [(path / n, f"{name}/{n}" if name else n) for n, is_dir in inside if not is_dir]
        else:
            out.append((path, name))
    return out


def _check(path: Path, items: list[StoredItem] | None, ledger: Ledger) -> FileCheck:
    try:
        size = os.stat(path).st_size
        if items is not None:
            return _items_check(path, size, items)
        if read_head(path, 4) == _ZIP_MAGIC:
            return _zip_check(path, size, ledger)
        if is_safetensors_file(path):
            return _safetensors_check(path, size)
    except OSError as exc:
        raise os_error(exc, path) from None
    return FileCheck(str(path), size)


def _zip_check(path: Path, size: int, ledger: Ledger) -> FileCheck:
    """Return the records of a ``torch.save`` file as spans, named by the tensors the reader found in them."""
    spans, problems = _zip_spans(path, 0, size, f"'{path.name}'")
    names = tuple(ledger.names(s.key) for s in spans)
    return FileCheck(str(path), size, spans, names, problems)


def _zip_spans(
    path: Path,
    start: int,
    end: int,
    what: str,
    fd: int | None = None,
    layouts: ZipLayouts | None = None,
) -> tuple[tuple[Written, ...], tuple[str, ...]]:
    """Return the records of the zip at bytes [start, end) of ``path``, or the problem of one that does not read.

    ``fd``: ``path`` open for reading, where the caller has it. ``layouts``: the last zips
    read, which a zip that repeats one is compared with instead of being parsed
    (``ZipLayouts``; DCP chunks of one shape), filled here.
    """
    own_fd = fd is None
    if fd is None:
        fd = open_source(path)
    try:
        if layouts is None:
            records = zip_records(fd, start, end, central=False)
        else:
            zip_file = FileSlice(fd, start, end, held=HELD)
            repeated = layouts.find(zip_file, end - start)
            if repeated is not None:
                records = repeated[0]
            else:
                records, found = read_layout(zip_file, end - start, chunk_own)
                if found is not None:
                    layouts.add(found)
    except DamagedZip as exc:
        return (), (f"{what} is not a readable torch.save zip ({exc})",)
    finally:
        if own_fd:
            os.close(fd)
    spans = tuple(
        Written(
            str(path),
            start + r.start,
            r.length,
            r.crcs,
            f"record '{r.name}' at byte {start + r.start}",
        )
        for r in sorted(records, key=lambda r: r.start)
        if r.length
    )
    return spans, ()


def _items_check(path: Path, size: int, items: list[StoredItem]) -> FileCheck:
    """Return the records of each item of a DCP data file; problems where items leave bytes unaccounted."""
    spans: list[Written] = []
    names: list[tuple[str, ...]] = []
    problems: list[str] = []
    at = 0
    layouts = ZipLayouts()
    fd = open_source(path)
    try:
        for item in sorted(items, key=lambda i: (i.offset, i.length)):
            if item.offset > at:
                problems.append(f"bytes {at}..{item.offset} belong to no item of .metadata")
            at = max(at, item.offset + item.length)
            if not item.zip or not item.length:
                continue
            what = f"the item of {item.key!r}"
            end = item.offset + item.length
            found, bad = _zip_spans(path, item.offset, end, what, fd, layouts)
            spans += found
            names += [(item.key,)] * len(found)
            problems += bad
    finally:
        os.close(fd)
    if at < size:
        problems.append(f"bytes {at}..{size} at its end belong to no item of .metadata")
    return FileCheck(str(path), size, tuple(spans), tuple(names), tuple(problems))


def _safetensors_check(path: Path, size: int) -> FileCheck:
    """Return a safetensors file's digests as spans; problems where its header does not fit the file."""
    try:
        start, head = header(path)
        offsets = sorted(
            (tuple(info["data_offsets"]), name)
            for name, info in head.items()
            if name != "__metadata__"
        )
        digests = read_digests(path)
    except (ValueError, KeyError, TypeError) as exc:
        return FileCheck(str(path), size, problems=(f"its header does not read ({exc})",))
    except BadInputError as exc:
        return FileCheck(str(path), size, problems=(exc.message,))
    problems = []
    at = 0
    for (a, b), name in offsets:
        if a > at:
            problems.append(f"the header puts no tensor at data bytes {at}..{a}")
        elif a < at:
            problems.append(f"the header puts {name!r} over another tensor's bytes")
        at = max(at, b)
    if start + at != size:
        problems.append(
            f"the header says the data ends at byte {start + at}, but the file has {size} bytes"
        )
    if digests is None:
        return FileCheck(str(path), size, problems=tuple(problems))
    order = sorted(digests.spans, key=digests.spans.__getitem__)
    spans = tuple(digests.written(n) for n in order if digests.spans[n][1])
    names = tuple((n,) for n in order if digests.spans[n][1])
    return FileCheck(str(path), size, spans, names, tuple(problems))
