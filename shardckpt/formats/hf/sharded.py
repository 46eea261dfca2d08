"""``hf``: a Hugging Face model directory: ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` shards + index.

Read: either, as ``from_pretrained`` reads them (``model.safetensors`` first), tied weights
``save_pretrained`` left out given back (``formats.hf.tied``). Written: shards + index.

``model.safetensors.index.json`` is ``{"metadata": {"total_size": N}, "weight_map":
{name: shard file}}``. It holds model weights only, named by FQN without a ``model.``
prefix. shardckpt reads it as ``{"model": {name: tensor}}``, the layout training loops
save and load (``dcp.load({"model": msd, ...})``), so ``hf -> dcp`` gives a checkpoint
FSDP2 training starts from, and ``dcp -> hf`` takes the ``model`` subtree back out.

Writing works like ``safetensors``: shards are planned from metadata alone (filled
in tree order up to ``--max-shard-size``; a bigger tensor gets a shard of its own, as
``huggingface_hub.split_torch_state_dict_into_shards`` does), the coordinator writes
each shard's header, every rank writes its rows into them, and the index comes last,
after the model's ``config.json`` and friends (``shardckpt.formats.hf.config``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from shardckpt.core.errors import SRC_FORMAT, BadInputError, UsageError
from shardckpt.core.files import has_file, os_error, writing
from shardckpt.core.lazy_torch import torch
from shardckpt.formats.base import Frame, Index, Reader, Rows, SourcePart, StoredRun, Writer
from shardckpt.formats.dcp import hf_storage_names
from shardckpt.formats.hf.config import CONFIG_FILE, copy_files, hf_config
from shardckpt.formats.hf.digests import Digests, read_digests
from shardckpt.formats.hf.safetensors_file import (
    data_starts,
    framed,
    layout,
    opened,
    read_rows,
    stored_run,
    tensor_meta,
)
from shardckpt.formats.hf.tied import source_ties, with_ties
from shardckpt.state.tree import TensorMeta, dotted, model_leaves, model_prefix

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
"""What ``save_pretrained`` writes, without an index, for a model under ``max_shard_size``."""
# What a transformers Trainer saves beside the model in its checkpoint-N/: not weights
# (its optimizer is optimizer.bin when it trained under FSDP with full state dicts).
_TRAINER_STATE = re.compile(
    r"optimizer\.(?:pt|bin)|scheduler\.pt|scaler\.pt|rng_state(?:_\d+)?\.pth"
    r"|trainer_state\.json|training_args\.bin"
)
# The model again, torch.save'd by FSDP with full state dicts for the Trainer's resume.
_TRAINER_FSDP_MODEL = "pytorch_model_fsdp.bin"
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # transformers' save_pretrained default, "5GB"


def model_tree(tree: Mapping, src: str) -> dict:
    """Return what an ``hf`` DST holds of ``tree``: ``{"model": {name: meta}}``, tensors only."""
    names: dict[str, tuple] = {}
    out: dict[str, TensorMeta] = {}
    prefix = model_prefix(tree)
    for path, leaf in model_leaves(tree):
        if not isinstance(leaf, TensorMeta):
            continue  # HF checkpoints hold weights only; plain values stay behind
        name = dotted(path[len(prefix) :])
        if name in names:
            raise UsageError(
                f"paths {list(names[name])} and {list(path)} both print as '{name}'",
                path=src,
                hint="rename one with --rename, or write --format torch",
            )
        names[name] = path
        out[name] = leaf
    if not out:
        raise UsageError(
            "has no model tensors to write as --format hf",
            path=src,
            hint="check --only and --filter against `shardckpt inspect`",
        )
    return {"model": out}


def plan_shards(metas: Sequence[TensorMeta], max_shard_size: int) -> list[list[TensorMeta]]:
    """Return the tensors of each shard: filled in order up to ``max_shard_size`` bytes."""
    shards: list[list[TensorMeta]] = []
    size = 0
    for meta in metas:
        if not shards or size + meta.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(meta)
        size += meta.nbytes
    return shards


def _plain_name(name: str) -> bool:
    return name not in ("", ".", "..") and Path(name).name == name


def shard_name(i: int, n: int) -> str:
    """Return the file name transformers gives shard ``i`` (0-based) of ``n``."""
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


class HfWriter(Writer):
    """Writes the shards' headers (coordinator), lets every rank fill them, then writes the index."""

    def __init__(self, root: Path, plan):
        super().__init__(root, plan)
        # What save_pretrained leaves out of a tied model (``config.check_names``).
        tied = plan.hf_config.tied if plan.hf_config is not None else {}
        named = [(n, meta) for n, meta in plan.tree["model"].items() if n not in tied]
        max_size = plan.max_shard_size or DEFAULT_MAX_SHARD_SIZE
        shards = plan_shards([meta for _, meta in named], max_size)
        name = {meta.key: n for n, meta in named}
        files = [shard_name(i, len(shards)) for i in range(len(shards))]
        self._headers = {
            file: layout([(name[m.key], m) for m in shard], {"format": "pt"}, file)
            for file, shard in zip(files, shards)
        }
        self._weight_map = {name[m.key]: file for file, shard in zip(files, shards) for m in shard}
        self._total = sum(meta.nbytes for _, meta in named)

    def frame(self, runtime) -> Frame:
        def create() -> None:
            for file, header in self._headers.items():
                header.write(self.root / file)

        runtime.agreed(lambda: create() if runtime.coordinator else None)
        return framed(list(self._headers.values()), self.plan.metas, runtime)

    def finish(self) -> None:
        if self.plan.hf_config is not None:
            copy_files(self.plan.hf_config, self.root)
        # Written last, so a directory with an index has all its shards.
        index = {"metadata": {"total_size": self._total}, "weight_map": self._weight_map}
        with writing(self.root / INDEX_FILE), open(self.root / INDEX_FILE, "w") as f:
            # transformers writes it this way (sorted keys, indent 2, newline).
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())


class HfReader(Reader):
    """Reads a Hugging Face model directory (``model.safetensors``, or shards and their index); rows with ``get_slice``.

    A directory with both is read as ``from_pretrained`` reads it: ``model.safetensors``.
    Tied weights ``save_pretrained`` left out come back as the model holds them
    (``formats.hf.tied``): read from the weight each is tied to.
    """

    format = "hf"

    def __init__(self, src, trust_pickle: bool = False):
        super().__init__(src, trust_pickle)
        weight_map = self._read_single() if self.single else self._read_index()
        self._file: dict[str, str] = {}
        self._metas: dict[str, TensorMeta] = {}
        self._digests: dict[str, Digests | None] = {}
        self._starts: dict[str, dict[str, int]] = {}
        for file in sorted(set(weight_map.values())):
            wanted = {name for name, f in weight_map.items() if f == file}
            for name, meta in self._read_shard(file, wanted):
                self._file[name] = file
                self._metas[name] = meta
            self._digests[file] = read_digests(self.src / file)
        self._tied: dict[str, str] = {}
        ties = source_ties(self.src, self._metas)
        self.untold = ties if isinstance(ties, str) else None
        """Why the ties ``config.json`` says cannot be given back, or None."""
        self.tie(ties if isinstance(ties, dict) else {})

    @property
    def single(self) -> bool:
        """Whether the weights are one ``model.safetensors``, which ``from_pretrained`` reads first."""
        return has_file(self.src / SINGLE_FILE, self.src)

    def tie(self, ties: Mapping[str, str]) -> None:
        """Give each tied name of ``ties`` (name to the weight it is tied to) that the files lack."""
        metas = with_ties(self._metas, ties)
        self._tied.update({name: ties[name] for name in metas if name not in self._metas})
        self._metas = metas

    def notes(self) -> list[str]:
        """Say which weights are given back tied, and an index left unread beside ``model.safetensors``."""
        out = [
            f"model.{name}: not in the files (save_pretrained leaves it out): read as "
            f"model.{source}, which it is tied to"
            for name, source in self._tied.items()
        ]
        if self.untold is not None:
            out.append(self.untold)
        if self.single and has_file(self.src / INDEX_FILE, self.src):
            out.append(
                f"reading {SINGLE_FILE}, as from_pretrained does; {INDEX_FILE} and its "
                "shards beside it are not read"
            )
        return out

    def _read_single(self) -> dict[str, str]:
        path = self.src / SINGLE_FILE
        with opened(path, "the file is truncated or damaged; re-copy it") as f:
            return {name: SINGLE_FILE for name in f.offset_keys()}

    def _read_index(self) -> dict[str, str]:
        index_path = self.src / INDEX_FILE
        if not has_file(index_path, self.src):
            raise BadInputError(
                f"no '{SINGLE_FILE}' or '{INDEX_FILE}' in this directory",
                path=self.src,
                hint="pass the directory save_pretrained wrote, or "
                f"{SRC_FORMAT} for another format",
            )
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
            ok = isinstance(weight_map, dict) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
            )
        except OSError as exc:
            raise os_error(exc, index_path) from None
        except (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError):
            ok = False
        if not ok:
            raise BadInputError(
                "not an index of safetensors shards (no 'weight_map' of names to files)",
                path=index_path,
                hint="re-save the model with save_pretrained, or re-copy the file",
            )
        # Shard names are plain file names: an index must not point outside its directory.
        for name, file in weight_map.items():
            if not _plain_name(file):
                raise BadInputError(
                    f"names '{file}' as the shard of '{name}', which is not a file name "
                    "in this directory",
                    path=index_path,
                    hint="an index lists the names of the shards beside it; re-save the model "
                    "with save_pretrained",
                )
        self._check_unlisted_shards(set(weight_map.values()), index_path)
        return weight_map

    def _check_unlisted_shards(self, listed: set[str], index_path: Path) -> None:
        """Refuse a file named like the index's shards that the index does not list."""
        patterns = {re.sub(r"\d+", r"\\d+", re.escape(name)) for name in listed}
        shard_like = re.compile("|".join(f"(?:{p})" for p in sorted(patterns)))
        for entry in sorted(self.src.iterdir()):
            if patterns and entry.name not in listed and shard_like.fullmatch(entry.name):
                raise BadInputError(
                    f"'{entry.name}' is named like a shard but {INDEX_FILE} does not list it",
                    path=index_path,
                    hint="the index and the shards do not match; re-save the model, or remove "
                    "the stray shard",
                )

    def _read_shard(self, file: str, wanted: set[str]) -> list[tuple[str, TensorMeta]]:
        path = self.src / file
        if not has_file(path, self.src):
            raise BadInputError(
                f"missing shard '{file}' named by {INDEX_FILE}",
                path=self.src,
                hint="copy every *.safetensors shard of the checkpoint",
            )
        with opened(path, "the shard is truncated or damaged; re-copy it") as f:
            # File order: the writer's tree order for our own output.
            keys = list(f.offset_keys())
            present = [k for k in keys if k in wanted]
            metas = [(k, tensor_meta(path, k, f.get_slice(k))) for k in present]
        self._starts[file] = data_starts(path)
        missing = sorted(wanted - set(present))
        if missing:
            raise BadInputError(
                f"has no tensor '{missing[0]}', which {INDEX_FILE} puts there",
                path=path,
                hint="the index and the shards do not match; re-copy the checkpoint",
            )
        unlisted = [k for k in keys if k not in wanted]
        if unlisted:
            raise BadInputError(
                f"holds tensor '{unlisted[0]}', which {INDEX_FILE} does not put there",
                path=path,
                hint="the index and the shards do not match; re-save the model, or add the "
                "tensor to the index's weight_map",
            )
        return metas

    def index(self) -> Index:
        return Index(self.format, str(self.src), 1, {"model": dict(self._metas)}, self._trainer)

    @property
    def _trainer(self) -> tuple[SourcePart, ...]:
        """A Trainer's state beside the model (its ``checkpoint-N/``): files carried unread."""
        return tuple(
            SourcePart(name, "file", None, _trainer_note(name))
            for name in sorted(p.name for p in self.src.iterdir())
            if _TRAINER_STATE.fullmatch(name) or name == _TRAINER_FSDP_MODEL
        )

    def members(self) -> frozenset[str]:
        """Return the index, its shards, and ``config.json`` with the friends an ``hf`` DST gets."""
        configs = hf_config(self.src).files if (self.src / CONFIG_FILE).exists() else ()
        index = () if self.single else (INDEX_FILE,)
        return frozenset({*index, *self._file.values(), *configs})

    def stored_runs(self, meta: TensorMeta, start: int, stop: int) -> list[StoredRun] | None:
        """Return where elements [start, stop) of ``meta`` lie in its shard: one run, as they are.

        A tied name's run is its weight's bytes, checked where that weight is read itself.
        """
        name = self._tied.get(meta.key, meta.key)
        file = self._file.get(name)
        if file is None:
            return None
        digests = None if meta.key in self._tied else self._digests[file]
        stored = self._metas.get(name)
        return stored_run(self.src / file, self._starts[file], stored, meta, start, stop, digests)

    def read(
        self, metas: Sequence[TensorMeta], rows: Sequence[Rows], runtime
    ) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(metas)
        by_file: dict[str, list[int]] = {}
        for i, meta in enumerate(metas):
            by_file.setdefault(self._file[self._tied.get(meta.key, meta.key)], []).append(i)
        for file, positions in by_file.items():
            own = [i for i in positions if metas[i].key not in self._tied]
            # A tied name's rows are its weight's bytes, checked where that weight is read itself.
            tied = [i for i in positions if metas[i].key in self._tied]
            for chosen, checked in ((own, self._digests[file]), (tied, None)):
                if not chosen:
                    continue
                got = read_rows(
                    self.src / file,
                    self._starts[file],
                    [
                        replace(metas[i], key=self._tied.get(metas[i].key, metas[i].key))
                        for i in chosen
                    ],
                    [rows[i] for i in chosen],
                    checked,
                )
                for i, tensor in zip(chosen, got):
                    out[i] = tensor
        return out  # type: ignore[return-value]


def _trainer_note(name: str) -> str:
    """Return what ``inspect`` says of the Trainer's file ``name``, carried unread."""
    if name == _TRAINER_FSDP_MODEL:
        return (
            "a transformers Trainer's FSDP copy of the model, for its resume (the weights are "
            "read from the safetensors)"
        )
    return "a transformers Trainer's state, not model weights"


def is_hf_dir(path: Path) -> bool:
    """Return whether ``path`` holds what ``from_pretrained`` reads: ``model.safetensors`` or an index."""
    if has_file(path / INDEX_FILE, path):
        return True
    # A stray model.safetensors beside torch's rank shards is theirs to name (hf-storage).
    return has_file(path / SINGLE_FILE, path) and not hf_storage_names.looks_like(path)
