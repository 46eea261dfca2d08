"""The records of a ``torch.save`` zip: where each one's bytes lie, and the CRC-32 written for them.

A zip keeps each record's CRC-32 twice: in the central directory, and in the record's
local header or, when the writer streamed the data first (``torch.save`` does: general
flag bit 3), in a data descriptor right after the data. ``torch.load`` reads neither
(pytorch/pytorch#126952), so a byte flipped in a tensor's data loads silently; these
positions let shardckpt check the bytes it reads against both, and patch both when it
writes a zip itself (``zip_skeleton``).
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
from dataclasses import dataclass

from shardckpt.codecs.pickle_scan import DamagedZip

_LOCAL_HEADER = 30
_CENTRAL_HEADER = 46
DATA_DESCRIPTOR = 0x08  # general-purpose flag bit 3
_DESCRIPTOR_SIGNATURE = b"PK\x07\x08"


class FileSlice(io.RawIOBase):
    """Bytes [start, end) of a file, seekable, as a file of their own (a zip inside a DCP file)."""

    def __init__(self, fd: int, start: int, end: int):
        self._fd, self._start, self._end, self._pos = fd, start, end, 0

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

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self._end - self._start - self._pos))
        data = os.pread(self._fd, n, self._start + self._pos)
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


def zip_records(fd: int, start: int, end: int, central: bool = True) -> list[ZipRecord]:
    """Return every record of the zip at bytes [start, end) of ``fd``, in central-directory order.

    ``central``: find where the central directory keeps each CRC-32 (for a writer that
    patches them); a reader needs only the values. Raises ``DamagedZip`` when the zip's
    directory does not read.
    """
    try:
        with zipfile.ZipFile(io.BufferedReader(FileSlice(fd, start, end))) as zf:
            infos = zf.infolist()
            directory = zf.start_dir
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError) as exc:
        raise DamagedZip(f"zip: {exc}") from None
    if not central:
        return [record(fd, start, info) for info in infos]
    out = []
    pos = directory
    for info in infos:
        fixed = os.pread(fd, _CENTRAL_HEADER, start + pos)
        if len(fixed) < _CENTRAL_HEADER:
            raise DamagedZip(f"zip: the headers of record {info.filename!r} are cut short")
        n, m, k = struct.unpack("<HHH", fixed[28:34])
        out.append(record(fd, start, info, pos + 16))
        pos += _CENTRAL_HEADER + n + m + k
    return out


def record(fd: int, start: int, info: zipfile.ZipInfo, central_at: int = -1) -> ZipRecord:
    """Return the record ``info`` describes in the zip at byte ``start`` of ``fd``.

    ``central_at``: where the central directory keeps its CRC-32, when the caller walked
    the directory (-1 when it only reads the values).
    """
    local = os.pread(fd, _LOCAL_HEADER, start + info.header_offset)
    if len(local) < _LOCAL_HEADER:
        raise DamagedZip(f"zip: the headers of record {info.filename!r} are cut short")
    (flags,) = struct.unpack("<H", local[6:8])
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    data = info.header_offset + _LOCAL_HEADER + name_len + extra_len
    if flags & DATA_DESCRIPTOR:
        # torch's writer leaves the local header's CRC 0 and puts it after the
        # data, in a descriptor that may start with its own signature.
        after = data + info.file_size
        descriptor = os.pread(fd, 8, start + after)
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


__all__ = ["DATA_DESCRIPTOR", "FileSlice", "ZipRecord", "record", "storage_key", "zip_records"]
