"""Reading a veRL ``FSDPCheckpointManager`` directory as one tree ``{"model", "optim"}``.

The model files are read as the local format they are (FSDP2: ``fsdp2-ranks``; FSDP1:
``fsdp1-sharded``), the optimizer files as FSDP2's ID-keyed DTensor state or FSDP1's
flat slices (``flat_optim``); both are joined by ``formats/parts.py``. The
``extra_state`` files (lr scheduler and RNG state, pickled numpy objects) are carried
unread: never unpickled, listed by ``inspect``, copied by a ``verl`` output.
"""

from __future__ import annotations

from shardckpt.core.errors import BadInputError
from shardckpt.core.files import os_error
from shardckpt.formats.base import SourcePart
from shardckpt.formats.fsdp1.flat_layout import FlatModel
from shardckpt.formats.fsdp1.sharded import Fsdp1ShardedReader
from shardckpt.formats.fsdp2.reader import Fsdp2RanksReader
from shardckpt.formats.ranks.rank_names import check_complete, present_rank_files
from shardckpt.formats.trainers.parts import Part, PartsReader
from shardckpt.formats.trainers.verl.flat_optim import FlatOptimReader
from shardckpt.formats.trainers.verl.names import (
    CONFIG_FILE,
    EXTRA,
    HF_DIR,
    MODEL,
    OPTIM,
    file_name,
    format_of,
    fsdp_version,
    parse,
    pattern,
    read_config,
)

CARRIED_NOTES = {
    EXTRA: "lr scheduler and RNG state of one rank (pickled numpy objects)",
    HF_DIR: "the model's Hugging Face config and tokenizer",
    CONFIG_FILE: "FSDP version and world size (written anew for DST's)",
}


class _Fsdp2Part(Fsdp2RanksReader):
    """One part's per-rank files (``model_…`` or ``optim_…``) read as ``fsdp2-ranks``."""

    def __init__(self, src, trust_pickle: bool, part: str):
        self.part = part
        super().__init__(src, trust_pickle)

    def present_files(self):
        return {self.part: present_rank_files(self.src)[self.part]}


class _Fsdp1Model(Fsdp1ShardedReader):
    """The model files of an FSDP1 save read as ``fsdp1-sharded`` (keyed ``model``)."""

    def present_files(self):
        return {MODEL: present_rank_files(self.src)[MODEL]}


class VerlReader(PartsReader):
    """Reads a veRL directory: model and optimizer by rank file, the rest carried unread."""

    format = "verl"

    def __init__(self, src, trust_pickle: bool = False, flat_model: FlatModel | None = None):
        self.flat_model = flat_model
        super().__init__(src, trust_pickle)

    def open_parts(self) -> tuple[list[Part], list[SourcePart]]:
        try:
            entries = sorted(self.src.iterdir(), key=lambda p: p.name)
        except OSError as exc:
            raise os_error(exc, self.src) from None
        sizes = {p[1] for e in entries if (p := parse(e.name)) is not None}
        if len(sizes) > 1:
            raise BadInputError(
                f"holds veRL files of jobs of {', '.join(map(str, sorted(sizes)))} ranks",
                path=self.src,
                hint="keep one save's files in the directory",
            )
        world_size = sizes.pop() if sizes else 0
        config = read_config(self.src)
        if config is not None and config.world_size != world_size:
            raise BadInputError(
                f"says world size {config.world_size}, but the rank files are for {world_size}",
                path=self.src / CONFIG_FILE,
                hint="keep one save's files in the directory",
            )
        carried = [c for e in entries if (c := self._carried(e.name)) is not None]
        has = {p[0] for e in entries if (p := parse(e.name)) is not None}
        model0 = self.src / file_name(MODEL, world_size, 0)
        version = config.version if config else fsdp_version(model0)
        self.format = format_of(version)
        parts = [self._model(version, world_size)]
        if OPTIM in has:
            parts.append(self._optim(version, world_size))
        return parts, carried

    def _carried(self, name: str) -> SourcePart | None:
        found = parse(name)
        if found is not None and found[0] != EXTRA:
            return None
        kind = EXTRA if found is not None else name
        note = CARRIED_NOTES.get(kind, "not a file veRL's manager writes")
        return SourcePart(name, "file", None, note)

    def _model(self, version: int, world_size: int) -> Part:
        where = pattern(MODEL, world_size)
        if version == 2:
            return Part(MODEL, where, _Fsdp2Part(self.src, self.trust_pickle, MODEL))
        return Part(MODEL, where, _Fsdp1Model(self.src, self.trust_pickle), MODEL)

    def _optim(self, version: int, world_size: int) -> Part:
        where = pattern(OPTIM, world_size)
        if version == 2:
            return Part(OPTIM, where, _Fsdp2Part(self.src, self.trust_pickle, OPTIM))
        files = present_rank_files(self.src)[OPTIM]
        check_complete(self.src, {OPTIM: files}, world_size)
        return Part(
            OPTIM, where, FlatOptimReader(self.src, self.trust_pickle, files, self.flat_model)
        )
