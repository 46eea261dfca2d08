"""``dcp-safetensors``: a DCP directory saved with ``FileSystemWriter(serialization_format=SAFETENSORS)``.

Its ``.metadata`` is DCP's, but every tensor entry of a data file points at the first
byte of the file's safetensors blob (``safetensors_header``): the blob's header says
where each chunk's data is. ``placed_metadata`` rewrites each tensor entry to that
place, after checking that the header holds that chunk (its offsets, shape and dtype);
from there it is a DCP checkpoint like any other, read by ``DcpReader`` with rows read
straight from the raw data (``RawRows``). Pickled values are stored as ``dcp`` stores them.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from shardckpt.core.errors import SRC_FORMAT, BadInputError
from shardckpt.core.files import source_stream
from shardckpt.formats.dcp import METADATA_FILE, plain_metadata
from shardckpt.formats.dcp.plain_metadata import StorageInfo
from shardckpt.formats.dcp.raw_rows import RawRows
from shardckpt.formats.dcp.reader import DcpReader, is_dcp_dir, read_metadata
from shardckpt.formats.dcp.safetensors_header import Entry, read_header

if TYPE_CHECKING:  # read without torch where torch is not loaded (``plain_metadata.py``)
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

_DAMAGED = "the .metadata and the data files are not one save; re-copy the checkpoint"


def looks_like(src: Path) -> bool:
    """Return whether DCP directory ``src`` stores its tensors as safetensors (read from one entry)."""
    try:
        md = read_metadata(src, trust_pickle=False)
        for index, info in (md.storage_data or {}).items():
            if index.offset is not None and info.length > 0:
                # Opened without blocking: a FIFO there is the reader's to refuse.
                with source_stream(_data_file(src, info.relative_path)) as f:
                    f.seek(info.offset)
                    head = f.read(9)
                return len(head) == 9 and head[8:9] == b"{"
    except Exception:  # noqa: BLE001 - detection only: the reader says what is wrong
        return False
    return False


def _data_file(src: Path, name: object) -> Path:
    """Return data file ``name`` of ``src``, refusing a name that leaves the directory."""
    parts = PurePosixPath(str(name)).parts
    path = src / str(name)
    inside = os.path.realpath(path).startswith(os.path.realpath(src) + os.sep)
    if not isinstance(name, str) or not name or ".." in parts or "\0" in name or not inside:
        raise BadInputError(
            f"stores data at {name!r}, outside the checkpoint directory",
            path=src / METADATA_FILE,
            hint="refusing to read it; re-copy the checkpoint from where it was written",
        )
    return path


def placed_metadata(md: Metadata, src: Path) -> Metadata:
    """Return ``md`` with each tensor entry moved to its chunk's data in its file's safetensors blob."""
    by_file: dict[str, list[MetadataIndex]] = {}
    for index, info in (md.storage_data or {}).items():
        if getattr(index, "offset", None) is not None:
            by_file.setdefault(getattr(info, "relative_path", None), []).append(index)
    storage_info = StorageInfo
    if not isinstance(md, plain_metadata.Metadata):  # torch's classes: torch is loaded
        from shardckpt.core.torch_internals import dcp_storage_info

        storage_info = dcp_storage_info()
    placed = dict(md.storage_data or {})
    for name, indexes in by_file.items():
        path = _data_file(src, name)
        infos = [md.storage_data[i] for i in indexes]
        if any(i.transform_descriptors for i in infos) or len({i.offset for i in infos}) != 1:
            raise BadInputError(
                f"the tensor entries of '{name}' are not one safetensors blob (they start at "
                "different bytes, or were transformed by an extension)",
                path=src / METADATA_FILE,
                hint=f"read it with {SRC_FORMAT} dcp if it was saved as torch.save",
            )
        header = read_header(path, infos[0].offset)
        for index in indexes:
            entry = _chunk_entry(md, index, header, path)
            placed[index] = storage_info(name, entry.start, entry.length)
    return dataclasses.replace(md, storage_data=placed)


def _chunk_entry(md: Metadata, index: MetadataIndex, header: dict[str, Entry], path: Path) -> Entry:
    """Return the header entry of chunk ``index``, once it holds what ``.metadata`` says."""
    fqn, offsets = index.fqn, tuple(index.offset)
    entry = header.get(fqn)
    tensor = md.state_dict_metadata.get(fqn)
    chunk = next((c for c in getattr(tensor, "chunks", ()) if tuple(c.offsets) == offsets), None)
    if entry is None or chunk is None:
        raise BadInputError(
            f"holds no safetensors entry for the chunk of {fqn!r} at {list(offsets)}",
            path=path,
            hint=_DAMAGED,
        )
    said = (tuple(chunk.sizes), tensor.properties.dtype)
    # Dtypes by name: .metadata's may be a stand-in (``state.dtypes``) and the header's torch's.
    if entry.offsets != offsets or (entry.shape, str(entry.dtype)) != (said[0], str(said[1])):
        raise BadInputError(
            f"holds {fqn!r} at {list(entry.offsets)} as {list(entry.shape)} {entry.dtype}, "
            f"where .metadata says {list(offsets)} as {list(said[0])} {said[1]} (torch's "
            "safetensors serialization keeps one chunk per key in a file)",
            path=path,
            hint=_DAMAGED,
        )
    return entry


class DcpSafetensorsReader(DcpReader):
    """A safetensors-serialized DCP directory: ``.metadata`` read safely, then placed by the headers."""

    format = "dcp-safetensors"
    rows_class = RawRows
    zip_items = False

    def load_metadata(self) -> Metadata:
        return placed_metadata(read_metadata(self.src, self.trust_pickle), self.src)


def is_safetensors_dcp_dir(src: Path) -> bool:
    """Return whether ``src`` is a DCP directory whose tensors are safetensors blobs."""
    return is_dcp_dir(src) and looks_like(src)
