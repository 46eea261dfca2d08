"""The format zoo: one module per on-disk format, and detection of a source's format."""

from __future__ import annotations

import os
import stat
import struct
from pathlib import Path

from shardckpt.errors import BadInputError, UsageError
from shardckpt.flat_layout import FlatModel
from shardckpt.formats.base import FullWriter, Index, Reader
from shardckpt.formats.dcp import METADATA_FILE, DcpReader
from shardckpt.formats.files import os_error, source_file, source_stat
from shardckpt.formats.fsdp1_local import Fsdp1LocalReader, detect_rank_format
from shardckpt.formats.fsdp1_sharded import Fsdp1ShardedReader
from shardckpt.formats.fsdp2_ranks import Fsdp2RanksReader
from shardckpt.formats.hf import INDEX_FILE, HfReader, HfWriter
from shardckpt.formats.rank_names import is_rank_dir
from shardckpt.formats.safetensors_file import SafetensorsReader, SafetensorsWriter
from shardckpt.formats.torch_file import TorchReader, TorchWriter

# Every format SPEC names, with its layout; only some are implemented so far.
LAYOUT_OF = {
    "dcp": "sharded",
    "torch": "full",
    "safetensors": "full",
    "hf": "full",
    "fsdp2-ranks": "local",
    "fsdp1-sharded": "local",
    "fsdp1-local": "local",
}
READERS: dict[str, type[Reader]] = {
    "dcp": DcpReader,
    "torch": TorchReader,
    "safetensors": SafetensorsReader,
    "hf": HfReader,
    "fsdp2-ranks": Fsdp2RanksReader,
    "fsdp1-sharded": Fsdp1ShardedReader,
    "fsdp1-local": Fsdp1LocalReader,
}
FULL_WRITERS: dict[str, type[FullWriter]] = {
    "torch": TorchWriter,
    "safetensors": SafetensorsWriter,
    "hf": HfWriter,
}
# File suffixes that name a format: a DST called so must be written in it.
FILE_SUFFIXES = {".pt": "torch", ".pth": "torch", ".bin": "torch", ".safetensors": "safetensors"}
SHARDED_WRITERS = {"dcp"}
LOCAL_WRITERS = {"fsdp2-ranks", "fsdp1-sharded", "fsdp1-local"}
# Outputs that are a directory of files (staged as a directory) rather than one file.
DIRECTORY_FORMATS = {"dcp", "hf", "fsdp2-ranks", "fsdp1-sharded", "fsdp1-local"}
SUPPORTED_READ = ", ".join(READERS)


def detect(src: Path) -> str:
    """Return the format of ``src`` judged from what is on disk."""
    if stat.S_ISDIR(source_stat(src).st_mode):
        if (src / METADATA_FILE).is_file():
            return "dcp"
        if (src / INDEX_FILE).is_file():
            return "hf"
        # FSDP1 is told by what its files hold; any other per-rank directory is FSDP2's.
        if (fmt := detect_rank_format(src)) is not None:
            return fmt
        if is_rank_dir(src):
            return "fsdp2-ranks"
        if any(p.suffix == ".distcp" for p in src.iterdir()):
            raise BadInputError(
                f"has *.distcp files but no '{METADATA_FILE}'",
                path=src,
                hint="the DCP save did not finish; use a checkpoint whose save completed",
            )
        raise BadInputError(
            "is a directory with no checkpoint in it",
            path=src,
            hint=f"pass a DCP directory (with '{METADATA_FILE}'), a directory of per-rank "
            "files (rank_0.pt, ...) or a checkpoint file",
        )
    try:
        with open(source_file(src), "rb") as f:
            head = f.read(9)
    except OSError as exc:
        raise os_error(exc, src) from None
    if head[:4] == b"PK\x03\x04" or head[:2] == b"\x80\x02":
        return "torch"
    if (
        len(head) == 9
        and head[8:9] == b"{"
        and struct.unpack("<Q", head[:8])[0] < os.path.getsize(src)
    ):
        return "safetensors"
    if not head:
        raise BadInputError(
            "is empty", path=src, hint="the file was not written completely; re-create it"
        )
    raise BadInputError(
        "cannot tell the format of this file",
        path=src,
        hint=f"pass --format with one of {SUPPORTED_READ}",
    )


def open_full_writer(
    fmt: str, path: Path, tree: dict, max_shard_size: int | None = None
) -> FullWriter:
    """Return the writer of full-layout format ``fmt`` for ``tree`` at ``path`` (rank 0 only)."""
    if fmt == "hf" and max_shard_size is not None:
        return HfWriter(path, tree, max_shard_size)
    return FULL_WRITERS[fmt](path, tree)


def open_reader(
    src: str | os.PathLike,
    fmt: str | None = None,
    trust_pickle: bool = False,
    flat_model: FlatModel | None = None,
) -> Reader:
    """Return a reader for ``src``, detecting its format unless ``fmt`` names one.

    ``flat_model`` (``--model``/``--wrap``) lets ``fsdp1-local`` name what its flat
    parameters hold; other formats do not need it.
    """
    path = Path(src)
    fmt = fmt or detect(path)
    if fmt not in LAYOUT_OF:
        raise UsageError(f"unknown format {fmt!r}", hint=f"use one of {', '.join(LAYOUT_OF)}")
    if fmt not in READERS:
        raise UsageError(
            f"reading format {fmt!r} is not supported yet",
            path=path,
            hint=f"shardckpt reads {SUPPORTED_READ} today",
        )
    if fmt == "fsdp1-local":
        return Fsdp1LocalReader(path, trust_pickle, flat_model)
    return READERS[fmt](path, trust_pickle)


__all__ = [
    "DIRECTORY_FORMATS",
    "FILE_SUFFIXES",
    "FULL_WRITERS",
    "LOCAL_WRITERS",
    "Index",
    "LAYOUT_OF",
    "LOCAL_WRITERS",
    "READERS",
    "SHARDED_WRITERS",
    "detect",
    "open_full_writer",
    "open_reader",
]
