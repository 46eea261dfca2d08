"""One byte flipped in a tensor's data, found by torch's own loader rather than by shardckpt.

``torch.load(map_location="meta")`` tells where each storage's bytes lie in its zip
(``_checkpoint_offset``); the zip's local headers tell which record that is. The tests
flip a byte there and expect the line that names the file, the tensor and the record.
"""

from __future__ import annotations

import io
import json
import shutil
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import MetadataIndex

from shardckpt.codecs.pickle_scan import quiet_protocol_warning
from shardckpt.formats.ranks.sharded_tensor_load import safe_globals

RECOPY = "the file was damaged after it was written; re-copy it"


@dataclass(frozen=True)
class Flipped:
    """Where a byte was flipped: the file, the tensors viewing the record, its name and data offset."""

    file: Path
    tensors: tuple[str, ...]
    where: str
    """The record, as messages name it: ``record 'archive/data/0' at byte 1088``."""

    def line(self) -> str:
        """Return the error line shardckpt must print for this damage (tied tensors: both named)."""
        return f"shardckpt: error: '{self.file}': {self.message()}: {RECOPY}"

    def message(self) -> str:
        """Return what the error says is damaged."""
        names = " and ".join(f"'{t}'" for t in self.tensors)
        return f"the bytes of {names} do not match the checksum written with them ({self.where})"


def in_record(name: str, start: int) -> str:
    """Return how messages name the zip record ``name`` whose data starts at byte ``start``."""
    return f"record '{name}' at byte {start}"


def copy(src: Path, dst: Path) -> Path:
    """Return ``dst``, a copy of file or directory ``src``."""
    if src.is_dir():
        shutil.copytree(src, dst)
    else:
        shutil.copy(src, dst)
    return dst


def flip(file: Path, at: int) -> None:
    """Flip the lowest bit of byte ``at`` of ``file``."""
    with open(file, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 1]))


def storages(source, weights_only: bool = True) -> dict[str, tuple[int, int]]:
    """Return each tensor's storage as (data offset in the zip, bytes), by dotted path, per torch's loader.

    ``weights_only=False`` for a file naming classes the test provides (DeepSpeed's look-alikes).
    """
    # torch 2.15 logs that a DeviceMesh is unpickled outside its job: not the test's output.
    with torch.serialization.safe_globals(safe_globals()), quiet_protocol_warning():
        obj = torch.load(source, map_location="meta", weights_only=weights_only)
    out: dict[str, tuple[int, int]] = {}

    def visit(node, path: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                visit(v, f"{path}.{k}" if path else str(k))
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                visit(v, f"{path}.{i}" if path else str(i))
        elif isinstance(node, torch.Tensor):
            shards = getattr(node, "local_shards", None)
            local = shards[0].tensor if shards else getattr(node, "_local_tensor", node)
            storage = local.untyped_storage()
            out[path] = (storage._checkpoint_offset, storage.nbytes())

    visit(obj, "")
    return out


def data_start(zip_bytes: bytes, info: zipfile.ZipInfo) -> int:
    """Return where the data of record ``info`` starts, after its local header (whose extra field
    torch pads for alignment, unlike the central directory's)."""
    header = zip_bytes[info.header_offset : info.header_offset + 30]
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_len + extra_len


def record_at(zip_bytes: bytes, start: int) -> str:
    """Return the name of the record whose data starts at ``start`` of a zip."""
    with zipfile.ZipFile(io.BytesIO(zip_bytes)) as zf:
        for info in zf.infolist():
            if data_start(zip_bytes, info) == start:
                return info.filename
    raise AssertionError(f"no record starts at byte {start}")


def flip_in_torch_file(file: Path, tensor: str, weights_only: bool = True) -> Flipped:
    """Flip a byte in the middle of ``tensor``'s data in a ``torch.save`` file (loaded as ``storages``)."""
    found = storages(file, weights_only)
    start, size = found[tensor]
    tied = tuple(name for name, (at, _) in found.items() if at == start)
    flipped = Flipped(file, tied, in_record(record_at(file.read_bytes(), start), start))
    flip(file, start + size // 2)
    return flipped


def flip_in_dcp(src: Path, key: str, offsets: tuple[int, ...] | None = None) -> Flipped:
    """Flip a byte in the middle of the data of ``key``'s chunk at ``offsets`` (the first chunk if None)."""
    md = FileSystemReader(src).read_metadata()
    if offsets is None:
        offsets = tuple(md.state_dict_metadata[key].chunks[0].offsets)
    info = md.storage_data[MetadataIndex(key, torch.Size(offsets))]
    file = src / info.relative_path
    item = file.read_bytes()[info.offset : info.offset + info.length]
    ((start, size),) = storages(io.BytesIO(item)).values()
    flipped = Flipped(file, (key,), in_record(record_at(item, start), info.offset + start))
    flip(file, info.offset + start + size // 2)
    return flipped


def flip_in_safetensors(file: Path, name: str) -> Flipped:
    """Flip a byte in the middle of tensor ``name``'s data in a safetensors file."""
    raw = file.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    a, b = json.loads(raw[8 : 8 + size])[name]["data_offsets"]
    start, stop = 8 + size + a, 8 + size + b
    flip(file, (start + stop) // 2)
    return Flipped(file, (name,), f"its data at bytes {start}..{stop}")
