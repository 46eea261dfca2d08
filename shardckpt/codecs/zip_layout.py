"""Zips laid out byte for byte as one read before, but for their own data: a DCP save's chunks.

A DCP save stores every chunk as a ``torch.save`` zip, and the chunks of one shape and
dtype are the same zip but for a few records' bytes (the storage's, the serialization
id's) and those records' CRC-32s. A zip whose every other byte equals those of a zip
whose directory was read has the same records in the same places: the bytes a zip
reader parses are the same bytes. So such a zip is placed by comparing those bytes with
the first one's (``ZipLayout.repeated_by``), not by parsing its directory again; a
single byte that differs sends it back to the zip reader.
"""

from __future__ import annotations

import io
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass

from shardckpt.codecs.pickle_scan import DamagedZip
from shardckpt.codecs.zip_records import FileSlice, ZipRecord, records_of, storage_key

_MAX_FIXED = 64 << 10
"""The most bytes compared per zip: past this a zip is parsed (comparing would read as much)."""


@dataclass(frozen=True)
class ZipLayout:
    """The bytes of a zip that others of its kind repeat, and its records."""

    size: int
    fixed: tuple[tuple[int, bytes], ...]
    """(where, the bytes there): every byte of the zip but its own records' data and CRC-32s."""
    records: tuple[ZipRecord, ...]
    """Every record, where the central directory was walked (``records_of``)."""
    own: frozenset[str]
    """The records whose bytes and CRC-32s are each zip's own."""

    @classmethod
    def of(
        cls,
        zip_file: FileSlice,
        size: int,
        zf: zipfile.ZipFile,
        records: list[ZipRecord],
        own: Callable[[str], bool],
    ) -> ZipLayout | None:
        """Return the layout of ``zip_file`` (``size`` bytes, open as ``zf``, whose ``records`` were read).

        ``own(name)``: whether record ``name``'s bytes are each zip's own. None when a
        record's CRC-32 positions are not known, when its records overlap each other or
        its directory (bytes of its own would then hide bytes the reader parses), or when
        more than ``_MAX_FIXED`` bytes would be compared.
        """
        mine = [r for r in records if own(r.name)]
        if any(at < 0 for r in mine for at in r.crc_at) or not _apart(zf, records, size):
            return None
        varying = sorted(
            [(r.start, r.start + r.length) for r in mine]
            + [(at, at + 4) for r in mine for at in r.crc_at]
        )
        fixed, at = [], 0
        for start, end in varying + [(size, size)]:
            if start > at:
                fixed.append((at, start))
            at = max(at, end)
        if sum(end - start for start, end in fixed) > _MAX_FIXED:
            return None
        held = tuple((start, zip_file.pread(end - start, start)) for start, end in fixed)
        if any(len(data) != end - start for (start, data), (_, end) in zip(held, fixed)):
            return None  # cut short: no other zip is compared with it
        return cls(size, held, tuple(records), frozenset(r.name for r in mine))

    def repeated_by(self, zip_file: FileSlice, size: int) -> list[ZipRecord] | None:
        """Return the records of ``zip_file`` (``size`` bytes) when it repeats this layout, else None.

        Its records lie where this layout's do; each one's CRC-32s are read from its own
        bytes.
        """
        if size != self.size:
            return None
        whole = zip_file.whole()  # a small zip, read in one piece: compared in place
        if whole is not None:
            if len(whole) != size:
                return None
            for at, data in self.fixed:
                if whole[at : at + len(data)] != data:
                    return None
        elif any(zip_file.pread(len(data), at) != data for at, data in self.fixed):
            return None
        out = []
        for r in self.records:
            if r.name in self.own:
                if whole is not None:
                    crcs = tuple(_u32(whole[at : at + 4]) for at in r.crc_at)
                else:
                    crcs = tuple(_u32(zip_file.pread(4, at)) for at in r.crc_at)
                r = ZipRecord(r.name, r.start, r.length, r.crc_at, crcs)
            out.append(r)
        return out


class ZipLayouts:
    """The layouts of the last zips read, a few of each size, each with what its reader made of it.

    Chunks of one size need not be of one kind (a weight's and a bias's may pickle to
    zips of the same length), and a file's chunks, in file order, take turns between
    kinds; so several are kept per size, the last one repeated tried first.
    """

    def __init__(self, per_size: int = 8):
        self._per_size = per_size
        self._by_size: dict[int, list[tuple[ZipLayout, object]]] = {}

    def find(self, zip_file: FileSlice, size: int) -> tuple[list[ZipRecord], object] | None:
        """Return the records of ``zip_file`` (``size`` bytes) and what was kept with the layout it repeats; None when it repeats none."""
        kept = self._by_size.get(size, [])
        for n, (layout, said) in enumerate(kept):
            records = layout.repeated_by(zip_file, size)
            if records is not None:
                if n:
                    kept.insert(0, kept.pop(n))
                return records, said
        return None

    def add(self, layout: ZipLayout, said: object = None) -> None:
        """Keep ``layout`` (and ``said``, what its reader made of it) for the zips after."""
        kept = self._by_size.setdefault(layout.size, [])
        kept.insert(0, (layout, said))
        del kept[self._per_size :]


def read_layout(
    zip_file: FileSlice, size: int, own: Callable[[str], bool]
) -> tuple[list[ZipRecord], ZipLayout | None]:
    """Return the records of ``zip_file`` (``size`` bytes), read by the zip reader, and its layout (``ZipLayout.of``).

    Raises ``DamagedZip`` when its directory does not read.
    """
    try:
        with zipfile.ZipFile(io.BufferedReader(zip_file)) as zf:
            records = records_of(zip_file, zf)
            return records, ZipLayout.of(zip_file, size, zf, records, own)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError) as exc:
        raise DamagedZip(f"zip: {exc}") from None


def _apart(zf: zipfile.ZipFile, records: list[ZipRecord], size: int) -> bool:
    """Return whether each record (its header and data) and the directory lie apart, in that order, each name once."""
    infos = zf.infolist()
    starts = {r.name: r.start for r in records}
    if len(starts) != len(infos) or len({i.filename for i in infos}) != len(infos):
        return False
    extents = sorted((i.header_offset, starts[i.filename] + i.file_size) for i in infos)
    extents.append((zf.start_dir, size))
    return all(end <= after for (_, end), (after, _) in zip(extents, extents[1:]))


def chunk_own(name: str) -> bool:
    """Return whether record ``name`` of a ``torch.save`` zip holds bytes each zip has its own: a storage, the serialization id."""
    return storage_key(name) is not None or name.endswith("/.data/serialization_id")


def _u32(data: bytes) -> int:
    return struct.unpack("<I", data)[0] if len(data) == 4 else -1


__all__ = ["ZipLayout", "ZipLayouts", "chunk_own", "read_layout"]
