"""The records of a ``torch.save`` zip: where each one's bytes lie, and the CRC-32 written for them.

A zip keeps each record's CRC-32 twice: in the central directory, and in the record's
local header or, when the writer streamed the data first (``torch.save`` does: general
flag bit 3), in a data descriptor right after the data. ``torch.load`` reads neither
(pytorch/pytorch#126952), so a byte flipped in a tensor's data loads silently; these
positions let shardckpt check the bytes it reads against both, and patch both when it
writes a zip itself (``zip_skeleton``).
"""

from __future__ import annotations

import bisect
import io
import struct
import zipfile
from dataclasses import dataclass

from shardckpt.codecs.pickle_scan import DamagedZip
from shardckpt.core.files import pread, pread_each

_LOCAL_HEADER = 30
_CENTRAL_HEADER = 46
DATA_DESCRIPTOR = 0x08  # general-purpose flag bit 3
_DESCRIPTOR_SIGNATURE = b"PK\x07\x08"
_DESCRIPTOR = 24
"""The most bytes a data descriptor takes (signed, with ZIP64 sizes): it ends where the next record's header begins."""
_NEAR = 4 << 10
"""Header windows closer than this are read as one range."""


class FileSlice(io.RawIOBase):
    """Bytes [start, end) of a file, seekable, as a file of their own (a zip inside a DCP file).

    ``held``: the first and the last ``held`` bytes (every byte, of a slice no longer than
    twice that) are read once, in one read each, and served from memory. A zip's reader
    reads its directory, its headers and its small records in many small reads, all
    there: a DCP chunk's zip costs one or two reads instead of about sixteen.
    """

    def __init__(self, fd: int, start: int, end: int, held: int = 0):
        self._fd, self._start, self._end, self._pos = fd, start, end, 0
        self._held: list[tuple[int, bytes]] = []  # (where in the slice, the bytes there)
        self._windows: list[tuple[int, bytes]] = []  # ``hold``'s, by where they start
        size = end - start
        self._whole = held > 0 and 0 < size <= 2 * held
        if held > 0 and size > 0:
            windows = [(0, size)] if self._whole else [(0, held), (size - held, held)]
            self._held = [(at, self.pread(n, at)) for at, n in windows]

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._end - self._start}[whence]
        self._pos = base + pos
        return self._pos

    def tell(self) -> int:
        return self._pos

    def hold(self, ranges: list[tuple[int, int]]) -> None:
        """Read ranges (start, length) of the slice now, those near each other as one, and serve reads inside them from memory.

        A zip's local headers lie one per record across the whole zip: asked for at once,
        each is a request of its own few bytes, where one at a time each would cost a
        block of the store's object around it (``remote_files.SMALL``).
        """
        size = self._end - self._start
        spans: list[list[int]] = []  # [start, end) of the slice
        for start, end in sorted((max(0, at), min(size, at + n)) for at, n in ranges):
            if end <= start or any(f <= start and end <= f + len(d) for f, d in self._held):
                continue
            if spans and start <= spans[-1][1] + _NEAR:
                spans[-1][1] = max(spans[-1][1], end)
            else:
                spans.append([start, end])
        if not spans:
            return
        found = pread_each(self._fd, [(self._start + a, b - a) for a, b in spans])
        self._windows = sorted([*self._windows, *((a, data) for (a, _), data in zip(spans, found))])

    def _in_window(self, n: int, at: int) -> bytes | None:
        i = bisect.bisect_right(self._windows, at, key=lambda w: w[0]) - 1
        if i >= 0:
            first, data = self._windows[i]
            if at + n <= first + len(data):
                return data[at - first : at - first + n]
        return None

    def whole(self) -> bytes | None:
        """Return every byte of the slice when it was read whole (``held``), else None; fewer where its file ends early."""
        return self._held[0][1] if self._whole else None

    def pread(self, n: int, at: int) -> bytes:
        """Return ``n`` bytes from byte ``at`` of the slice; fewer where the slice or its file ends."""
        n = max(0, min(n, self._end - self._start - at))
        for first, data in self._held:
            if first <= at and at + n <= first + len(data):
                return data[at - first : at - first + n]
        if self._windows and (held := self._in_window(n, at)) is not None:
            return held
        return pread(self._fd, n, self._start + at)

    def readinto(self, buffer) -> int:
        data = self.pread(len(buffer), self._pos)
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)


@dataclass(frozen=True)
class ZipRecord:
    """One record of a zip, positions counted from the zip's first byte."""

    name: str
    start: int
    """Where the record's data begins."""
    length: int
    crc_at: tuple[int, int]
    """Where its CRC-32 is written: the local header (or data descriptor), the central directory."""
    crcs: tuple[int, int]
    """The CRC-32 values written there, in that order."""

    @property
    def storage_key(self) -> str | None:
        """Return ``K`` for a ``torch.save`` storage record ``<archive>/data/K``, else None."""
        return storage_key(self.name)


def storage_key(name: str) -> str | None:
    """Return ``K`` for the name of a ``torch.save`` storage record ``<archive>/data/K``, else None."""
    head, _, tail = name.partition("/data/")
    return tail if tail.isdigit() and "/" not in head else None


HELD = 32 << 10
"""Bytes a zip's reader holds of each end of a zip (``FileSlice``): more than a chunk's directory and pickle."""


def zip_records(fd: int, start: int, end: int, central: bool = True) -> list[ZipRecord]:
    """Return every record of the zip at bytes [start, end) of ``fd``, in central-directory order.

    ``central``: find where the central directory keeps each CRC-32 (for a writer that
    patches them); a reader needs only the values. Raises ``DamagedZip`` when the zip's
    directory does not read.
    """
    zip_file = FileSlice(fd, start, end, held=HELD)
    try:
        with zipfile.ZipFile(io.BufferedReader(zip_file)) as zf:
            return records_of(zip_file, zf, central)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError) as exc:
        raise DamagedZip(f"zip: {exc}") from None


def records_of(zip_file: FileSlice, zf: zipfile.ZipFile, central: bool = True) -> list[ZipRecord]:
    """Return every record of ``zf``, the zip ``zip_file`` holds, as ``zip_records`` does."""
    infos = zf.infolist()
    # Each record's local header, and the data descriptor of the record before it.
    zip_file.hold(
        [(i.header_offset - _DESCRIPTOR, _DESCRIPTOR + _LOCAL_HEADER) for i in infos]
        + [(zf.start_dir - _DESCRIPTOR, _DESCRIPTOR)]
    )
    if not central:
        return [record(zip_file, info) for info in infos]
    out = []
    pos = zf.start_dir
    for info in infos:
        fixed = zip_file.pread(_CENTRAL_HEADER, pos)
        if len(fixed) < _CENTRAL_HEADER:
            raise DamagedZip(f"zip: the headers of record {info.filename!r} are cut short")
        n, m, k = struct.unpack("<HHH", fixed[28:34])
        out.append(record(zip_file, info, pos + 16))
        pos += _CENTRAL_HEADER + n + m + k
    return out


def record(zip_file: FileSlice, info: zipfile.ZipInfo, central_at: int = -1) -> ZipRecord:
    """Return the record ``info`` describes in ``zip_file``.

    ``central_at``: where the central directory keeps its CRC-32, when the caller walked
    the directory (-1 when it only reads the values).
    """
    local = zip_file.pread(_LOCAL_HEADER, info.header_offset)
    if len(local) < _LOCAL_HEADER:
        raise DamagedZip(f"zip: the headers of record {info.filename!r} are cut short")
    (flags,) = struct.unpack("<H", local[6:8])
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    data = info.header_offset + _LOCAL_HEADER + name_len + extra_len
    if flags & DATA_DESCRIPTOR:
        # torch's writer leaves the local header's CRC 0 and puts it after the
        # data, in a descriptor that may start with its own signature.
        after = data + info.file_size
        descriptor = zip_file.pread(8, after)
        signed = descriptor[:4] == _DESCRIPTOR_SIGNATURE
        local_at = after + (4 if signed else 0)
        written = descriptor[4:8] if signed else descriptor[:4]
    else:
        local_at = info.header_offset + 14
        written = local[14:18]
    local_crc = struct.unpack("<I", written)[0] if len(written) == 4 else -1
    return ZipRecord(
        info.filename, data, info.file_size, (local_at, central_at), (local_crc, info.CRC)
    )


__all__ = [
    "DATA_DESCRIPTOR",
    "FileSlice",
    "HELD",
    "ZipRecord",
    "record",
    "records_of",
    "storage_key",
    "zip_records",
]
