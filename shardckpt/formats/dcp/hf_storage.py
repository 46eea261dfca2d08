"""``hf-storage``: the per-rank safetensors shards torch's ``HuggingFaceStorageWriter`` saves.

``dcp.save(..., storage_writer=HuggingFaceStorageWriter(path, save_distributed=True))``
(what torchtitan's HF save writes before it consolidates) leaves one file per rank
and file index, ``shard-0000R-model-0000K-of-0000N.safetensors`` (R from 1), each a
safetensors file of that rank's chunks with their offsets in ``__metadata__``, and no
``.metadata``. ``hf_storage_metadata`` builds DCP's metadata from the headers alone, as
torch's ``HuggingFaceStorageReader`` does; from there it is read as ``dcp`` is.

What the files cannot say: how many ranks saved. A tensor's global shape is where its
chunks end, so a directory missing its last rank's files reads as smaller tensors;
the shard numbers must run from 1 without a gap, each with all its K files.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from shardckpt.core.errors import BadInputError
from shardckpt.core.files import os_error
from shardckpt.core.torch_internals import dcp_storage_info
from shardckpt.formats.dcp import METADATA_FILE
from shardckpt.formats.dcp.hf_storage_names import SHARD_FILE
from shardckpt.formats.dcp.raw_rows import RawRows
from shardckpt.formats.dcp.reader import DcpReader
from shardckpt.formats.dcp.safetensors_header import Entry, read_header

_RECOPY = "copy every shard-*.safetensors file of the save into the directory"


def shard_files(src: Path) -> dict[str, int]:
    """Return each shard file of ``src`` with its rank, once every rank has all its files."""
    try:
        names = sorted(p.name for p in src.iterdir() if p.is_file())
    except OSError as exc:
        raise os_error(exc, src) from None
    found: dict[int, dict[int, int]] = {}
    files: dict[str, int] = {}
    for name in names:
        m = SHARD_FILE.fullmatch(name)
        if m is None:
            if name.endswith(".safetensors"):
                raise BadInputError(
                    f"'{name}' is no rank shard (shard-0000R-model-0000K-of-0000N.safetensors)",
                    path=src,
                    hint="move it out: the checkpoint is the shard files of one save",
                )
            continue
        rank, index, count = (int(g) for g in m.groups())
        found.setdefault(rank, {})[index] = count
        files[name] = rank - 1
    if not files:
        raise BadInputError(
            "holds no shard-0000R-model-0000K-of-0000N.safetensors file", path=src, hint=_RECOPY
        )
    for rank in range(1, max(found) + 1):
        counts = found.get(rank, {})
        total = max(counts.values(), default=0)
        missing = [k for k in range(1, total + 1) if k not in counts]
        if not counts or missing or set(counts.values()) != {total}:
            which = f"shard-{rank:05d}-model-*" if not counts else f"shard-{rank:05d} files"
            raise BadInputError(f"misses {which} of the save", path=src, hint=_RECOPY)
    return files


def _chunks(src: Path, files: dict[str, int]) -> Iterator[tuple[str, str, Entry]]:
    """Yield ``(file, fqn, entry)`` for every chunk in the shard files' headers."""
    for name in files:
        for fqn, entry in read_header(src / name).items():
            yield name, fqn, entry


def hf_storage_metadata(src: Path) -> Metadata:
    """Return DCP metadata for the shard files in ``src``: each chunk where its header puts it."""
    storage_info = dcp_storage_info()
    tensors: dict[str, TensorStorageMetadata] = {}
    storage: dict[MetadataIndex, object] = {}
    for name, fqn, entry in _chunks(src, shard_files(src)):
        index = MetadataIndex(fqn, torch.Size(entry.offsets))
        if index in storage:
            raise BadInputError(
                f"holds the chunk of {fqn!r} at {list(entry.offsets)} that "
                f"'{storage[index].relative_path}' holds too",  # type: ignore[attr-defined]
                path=src / name,
                hint="the shard files are of two saves; keep one save's files",
            )
        storage[index] = storage_info(name, entry.start, entry.length)
        chunk = ChunkStorageMetadata(torch.Size(entry.offsets), torch.Size(entry.shape))
        known = tensors.get(fqn)
        if known is None:
            tensors[fqn] = TensorStorageMetadata(
                TensorProperties(dtype=entry.dtype), torch.Size(entry.shape), [chunk]
            )
            known = tensors[fqn]
        elif known.properties.dtype != entry.dtype or len(known.size) != len(entry.shape):
            raise BadInputError(
                f"holds {fqn!r} as {entry.dtype} of {len(entry.shape)} dims, and another "
                f"shard as {known.properties.dtype} of {len(known.size)}",
                path=src / name,
                hint="the shard files are of two saves; keep one save's files",
            )
        else:
            known.chunks.append(chunk)
        ends = [o + s for o, s in zip(entry.offsets, entry.shape)]
        known.size = torch.Size(max(a, b) for a, b in zip(known.size, ends))
    return Metadata(state_dict_metadata=tensors, storage_data=storage)  # type: ignore[arg-type]


class HfStorageReader(DcpReader):
    """HF-storage shards, read as DCP from the metadata their headers give; rank R-1 wrote ``shard-0000R``."""

    format = "hf-storage"
    rows_class = RawRows
    zip_items = False

    def load_metadata(self) -> Metadata:
        return hf_storage_metadata(self.src)

    def _check(self) -> None:
        # DCP's checks speak of a .metadata, which these shards do not have: the
        # metadata is their headers'.
        try:
            super()._check()
        except BadInputError as exc:
            if exc.path != os.fspath(self.src / METADATA_FILE):
                raise
            raise BadInputError(
                exc.message, path=self.src, hint=f"the shard files are not one save; {_RECOPY}"
            ) from None

    def rank_of_file(self, name: str) -> int | None:
        m = SHARD_FILE.fullmatch(name)
        return int(m.group(1)) - 1 if m else None
