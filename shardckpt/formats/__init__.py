"""The format zoo: one module per on-disk format, and detection of a source's format."""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shardckpt.errors import SRC_FORMAT, BadInputError, UsageError
from shardckpt.flat_layout import FlatModel
from shardckpt.formats.accelerate import AccelerateReader, AccelerateWriter, looks_like
from shardckpt.formats.base import Index, Reader, Writer
from shardckpt.formats.dcp import METADATA_FILE, DcpReader, dcp_tells_whole
from shardckpt.formats.dcp_write import DcpWriter
from shardckpt.formats.deepspeed.detect import detect_dir as detect_deepspeed
from shardckpt.formats.deepspeed.lone_file import refuse_lone_file
from shardckpt.formats.deepspeed.not_written import NotWritten
from shardckpt.formats.deepspeed.reader import DeepSpeedModuleReader, DeepSpeedReader
from shardckpt.formats.deepspeed.universal import UniversalReader
from shardckpt.formats.files import os_error, source_file, source_stat
from shardckpt.formats.fsdp1_local import Fsdp1LocalReader, detect_rank_format
from shardckpt.formats.fsdp1_sharded import Fsdp1ShardedReader
from shardckpt.formats.fsdp1_write import Fsdp1LocalWriter, Fsdp1ShardedWriter
from shardckpt.formats.fsdp2_ranks import Fsdp2RanksReader
from shardckpt.formats.fsdp2_ranks_write import Fsdp2RanksWriter
from shardckpt.formats.hf import INDEX_FILE, HfReader, HfWriter, model_tree
from shardckpt.formats.lightning import META_FILE, LightningReader, LightningWriter
from shardckpt.formats.rank_names import is_rank_dir
from shardckpt.formats.safetensors_file import SafetensorsReader, SafetensorsWriter
from shardckpt.formats.torch_checkpointing import (
    TorchCheckpointingReader,
    is_torch_checkpointing_dir,
)
from shardckpt.formats.torch_checkpointing_write import TorchCheckpointingWriter
from shardckpt.formats.torch_file import TorchReader, TorchWriter
from shardckpt.formats.torchtitan import (
    TorchtitanReader,
    components,
    titan_tree,
    world_size_notes,
)
from shardckpt.formats.torchtitan import looks_like as looks_like_torchtitan
from shardckpt.sight import Sight


def _never(_index: Index) -> bool:
    return False


def _always(_index: Index) -> bool:
    return True


def _as_is(tree: dict, _src: str) -> dict:
    return tree


def _no_notes(_tree: dict, _world_size: int) -> list[str]:
    return []


@dataclass(frozen=True)
class Format:
    """Everything about one on-disk format that code outside ``formats/`` may ask."""

    name: str
    layout: str
    """``full``, ``sharded`` or ``local`` (SPEC's layouts)."""
    title: str
    """How messages name it ("a DCP checkpoint")."""
    reader: type[Reader]
    writer: type[Writer]
    directory: bool
    """Whether the format is a directory of files (staged as one) rather than one file."""
    suffixes: tuple[str, ...] = ()
    """File suffixes that name this format: a DST called so must be written in it."""
    default_for: str | None = None
    """The layout this format is written in when ``--format`` is not given."""
    min_world_size: int = 1
    """The fewest target ranks the format can describe (FSDP1 on one rank runs NO_SHARD)."""
    needs_model: bool = False
    """Whether reading and writing it needs ``--model``/``--wrap`` (FSDP1 flat parameters)."""
    max_shard_size: bool = False
    """Whether ``--max-shard-size`` applies."""
    keys_as_str: bool = False
    """Whether it hands every mapping key back as ``str`` (DCP): compare trees in that form."""
    tells_whole: Callable[[Index], bool] = _never
    """Whether a source in this format says which tensors every rank held whole."""
    dst_tree: Callable[[dict, str], dict] = _as_is
    """The part of a selected tree this format holds (``hf``: model tensors only)."""
    src_local: bool = False
    """Whether a source can be read from files spread over the ranks' own disks (``sight``)."""
    carries_files: bool = False
    """Whether it copies the files a source carries unread (``Index.parts``) into DST."""
    components: Callable[[dict], list] | None = None
    """A trainer's checkpoint: the parts of its tree (model, optimizer, ...) ``inspect`` lists."""
    notes: Callable[[dict, int], list[str]] = _no_notes
    """What to tell the user about DST's tree at a world size (parts the trainer will not
    take as they are there), said once on stderr."""


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format(
            "dcp",
            "sharded",
            "DCP",
            DcpReader,
            DcpWriter,
            directory=True,
            default_for="sharded",
            keys_as_str=True,
            tells_whole=dcp_tells_whole,
            src_local=True,
        ),
        Format(
            "torch-checkpointing",
            "sharded",
            "torch_checkpointing",
            TorchCheckpointingReader,
            TorchCheckpointingWriter,
            directory=True,
            tells_whole=_always,
        ),
        Format(
            "torch",
            "full",
            "torch",
            TorchReader,
            TorchWriter,
            False,
            (".pt", ".pth", ".bin"),
            "full",
        ),
        Format(
            "safetensors",
            "full",
            "safetensors",
            SafetensorsReader,
            SafetensorsWriter,
            False,
            (".safetensors",),
        ),
        Format(
            "hf",
            "full",
            "Hugging Face",
            HfReader,
            HfWriter,
            directory=True,
            max_shard_size=True,
            dst_tree=model_tree,
        ),
        Format(
            "lightning",
            "sharded",
            "Lightning",
            LightningReader,
            LightningWriter,
            directory=True,
            keys_as_str=True,
            tells_whole=dcp_tells_whole,
        ),
        Format(
            "fsdp2-ranks",
            "local",
            "FSDP2 per-rank",
            Fsdp2RanksReader,
            Fsdp2RanksWriter,
            directory=True,
            default_for="local",
            tells_whole=_always,
        ),
        Format(
            "fsdp1-sharded",
            "local",
            "FSDP1 sharded",
            Fsdp1ShardedReader,
            Fsdp1ShardedWriter,
            directory=True,
            min_world_size=2,
            tells_whole=_always,
        ),
        Format(
            "fsdp1-local",
            "local",
            "FSDP1 local",
            Fsdp1LocalReader,
            Fsdp1LocalWriter,
            directory=True,
            min_world_size=2,
            needs_model=True,
            tells_whole=_always,
        ),
        Format(
            "accelerate",
            "sharded",
            "accelerate",
            AccelerateReader,
            AccelerateWriter,
            directory=True,
            keys_as_str=True,
            tells_whole=dcp_tells_whole,
            carries_files=True,
        ),
        Format(
            "torchtitan",
            "sharded",
            "torchtitan",
            TorchtitanReader,
            DcpWriter,
            directory=True,
            keys_as_str=True,
            tells_whole=dcp_tells_whole,
            dst_tree=titan_tree,
            src_local=True,
            components=components,
            notes=world_size_notes,
        ),
        # Sources only: a ZeRO save is per-rank files of one world size.
        Format(
            "deepspeed",
            "local",
            "DeepSpeed ZeRO",
            DeepSpeedReader,
            NotWritten,
            directory=True,
            tells_whole=_always,
        ),
        Format(
            "deepspeed-module",
            "local",
            "DeepSpeed ZeRO (module weights)",
            DeepSpeedModuleReader,
            NotWritten,
            directory=True,
            tells_whole=_always,
        ),
        Format(
            "deepspeed-universal",
            "local",
            "DeepSpeed universal",
            UniversalReader,
            NotWritten,
            directory=True,
            tells_whole=_always,
        ),
    )
}
FILE_SUFFIXES = {suffix: f.name for f in FORMATS.values() for suffix in f.suffixes}
SUPPORTED_READ = ", ".join(FORMATS)


def format_named(name: str) -> Format:
    """Return the format called ``name``; refuse an unknown name."""
    if name not in FORMATS:
        raise UsageError(f"unknown format {name!r}", hint=f"use one of {SUPPORTED_READ}")
    return FORMATS[name]


def default_format(layout: str, dst: str | os.PathLike) -> str:
    """Return the format SPEC writes a layout in when no ``--format`` is given (by DST's suffix for full)."""
    named = FILE_SUFFIXES.get(Path(dst).suffix.lower())
    if named is not None and FORMATS[named].layout == layout:
        return named
    return next(f.name for f in FORMATS.values() if f.default_for == layout)


def detect(src: Path) -> str:
    """Return the format of ``src`` judged from what is on disk."""
    if stat.S_ISDIR(source_stat(src).st_mode):
        # DeepSpeed's names first: an HF Trainer checkpoint-N/ holds other formats' files too.
        if (fmt := detect_deepspeed(src)) is not None:
            return fmt
        if (src / METADATA_FILE).is_file():
            # Lightning's sharded checkpoints keep what is not DCP's beside it.
            if (src / META_FILE).is_file():
                return "lightning"
            return "torchtitan" if looks_like_torchtitan(src) else "dcp"
        if is_torch_checkpointing_dir(src):
            return "torch-checkpointing"
        if (src / INDEX_FILE).is_file():
            return "hf"
        if looks_like(src):
            return "accelerate"
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
    refuse_lone_file(src)
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
        hint=f"pass {SRC_FORMAT} with one of {SUPPORTED_READ}",
    )


def open_reader(
    src: str | os.PathLike,
    fmt: str | None = None,
    trust_pickle: bool = False,
    flat_model: FlatModel | None = None,
    sight: Sight | None = None,
) -> Reader:
    """Return a reader for ``src``, detecting its format unless ``fmt`` names one.

    ``flat_model`` (``--model``/``--wrap``) lets ``fsdp1-local`` name what its flat
    parameters hold; other formats do not need it. ``sight`` (who sees which of SRC's
    files, under ``torchrun``) makes a reader read only files its rank sees; where not
    every rank sees every file, only a format that can (``Format.src_local``) is read.
    """
    path = Path(src)
    if sight is None:
        form = format_named(fmt or detect(path))
    else:
        # Detected where the most of SRC is seen (the coordinator's node, which holds
        # DCP's .metadata, in a job that saved to node-local disks).
        form = format_named(
            fmt or sight.shared(sight.files_of(sight.most_seeing()), lambda: detect(path))
        )
        if sight.complete:
            sight = None
        elif not form.src_local:
            raise BadInputError(
                f"not every rank sees every file of this {form.title} checkpoint, and such a "
                "source is read from one filesystem every rank sees",
                path=path,
                hint="copy SRC where every rank sees it (only DCP sources are read from "
                "node-local disks)",
            )
    if form.needs_model:
        return form.reader(path, trust_pickle, flat_model)
    if sight is not None:
        return form.reader(path, trust_pickle, sight)  # type: ignore[call-arg]
    return form.reader(path, trust_pickle)


__all__ = [
    "FILE_SUFFIXES",
    "FORMATS",
    "Format",
    "Index",
    "SUPPORTED_READ",
    "default_format",
    "detect",
    "format_named",
    "open_reader",
]
