"""``accelerate``: a directory ``Accelerator.save_state`` wrote, read as one tree and written at M.

Which file is which part (accelerate 1.x names, ``i`` > 0 for a job's second model etc.):

- ``pytorch_model_fsdp_{i}/`` (DCP of ``{"model": ...}``, FSDP ``SHARDED_STATE_DICT``),
  ``pytorch_model_fsdp[_i].bin`` (FSDP ``FULL_STATE_DICT``), ``model[_i].safetensors`` /
  ``pytorch_model[_i].bin`` (no FSDP): key ``model`` (``model_{i}``);
- ``optimizer_{i}/`` (DCP of ``{"optimizer": ...}``) or ``optimizer[_i].bin``: key
  ``optimizer`` (``optimizer_{i}``);
- ``scheduler[_i].bin``, ``scaler.pt``, ``dl_state_dict[_i].bin``: plain state dicts,
  read (weights-only) under their name (``scheduler``, ...);
- ``random_states_{r}.pkl`` (each rank's RNG state: numpy objects), ``sampler[_i].bin`` (a
  pickled sampler), ``custom_checkpoint_{i}.pkl`` and anything else: carried unread, as
  files (listed by ``inspect``, copied as they are into an ``accelerate`` output).

Written (``--to sharded --format accelerate``), DST is what ``load_state`` of a job with
``state_dict_type=SHARDED_STATE_DICT`` takes at M processes: each model and optimizer
as the DCP directory accelerate's loader reads, every other file copied unchanged.
"""

from __future__ import annotations

import re
from pathlib import Path

from shardckpt.core.errors import SRC_FORMAT, BadInputError, UnsafePickleError, UsageError, notice
from shardckpt.formats.base import Index, SourcePart
from shardckpt.formats.dcp.reader import DcpReader
from shardckpt.formats.dcp.writer import DcpWriter
from shardckpt.formats.hf.safetensors_file import SafetensorsReader
from shardckpt.formats.torch_save.file import TorchReader
from shardckpt.formats.trainers.accelerate_names import MODEL_DIR, MODEL_FILE, OPTIM_DIR, RNG_FILE
from shardckpt.formats.trainers.parts import Part, PartsReader, PartsWriter, SubCheckpoint
from shardckpt.state.tree import is_optimizer

_OPTIM_FILE = re.compile(r"optimizer(?:_(\d+))?\.bin")
_VALUE_FILE = re.compile(r"(scheduler|dl_state_dict)(?:_(\d+))?\.bin|(scaler)\.pt")
_RANK_FILE = re.compile(r".*_rank(\d+)\.bin")
_CARRIED = (
    (RNG_FILE, "RNG state of one rank (pickled numpy objects)"),
    (re.compile(r"sampler(?:_\d+)?\.bin"), "a data sampler (a pickled object)"),
    (re.compile(r"custom_checkpoint_\d+\.pkl"), "a registered object's state (a pickle)"),
)


def _key(name: str, index: str | None) -> str:
    """Return the tree key of part ``name`` of a job's ``index``-th model/optimizer/..."""
    return name if not index or index == "0" else f"{name}_{index}"


class AccelerateReader(PartsReader):
    """Reads a ``save_state`` directory: models and optimizers as tensors, small state as values."""

    format = "accelerate"

    def open_parts(self) -> tuple[list[Part], list[SourcePart]]:
        parts: list[Part] = []
        carried: list[SourcePart] = []
        for path, is_dir in self.entries():
            name = path.name
            if is_dir:
                # A model or optimizer directory without .metadata is a save that did not
                # finish: DcpReader says so, naming it.
                if m := MODEL_DIR.fullmatch(name):
                    parts.append(Part(_key("model", m.group(1)), name, self._dcp(path), "model"))
                elif m := OPTIM_DIR.fullmatch(name):
                    parts.append(
                        Part(_key("optimizer", m.group(1)), name, self._dcp(path), "optimizer")
                    )
                else:
                    carried.append(
                        SourcePart(name, "file", None, "a directory save_state does not write")
                    )
            elif _RANK_FILE.fullmatch(name):
                raise BadInputError(
                    "is a per-rank file of accelerate's use_dcp=False or LOCAL_STATE_DICT save, "
                    "which shardckpt does not read",
                    path=path,
                    hint="save with SHARDED_STATE_DICT (use_dcp=True) or FULL_STATE_DICT",
                )
            elif m := MODEL_FILE.fullmatch(name):
                parts.append(Part(_key("model", m.group(1)), name, self._file(path)))
            elif m := _OPTIM_FILE.fullmatch(name):
                parts.append(Part(_key("optimizer", m.group(1)), name, self._file(path)))
            elif m := _VALUE_FILE.fullmatch(name):
                try:
                    reader = self._file(path)
                except UnsafePickleError as exc:
                    carried.append(SourcePart(name, "file", None, f"not read: {exc.message}"))
                    continue
                parts.append(Part(_key(m.group(1) or m.group(3), m.group(2)), name, reader))
            else:
                note = next((n for pattern, n in _CARRIED if pattern.fullmatch(name)), "")
                carried.append(
                    SourcePart(name, "file", None, note or "not a file save_state writes")
                )
        # Models first, then optimizers, then the rest, as a training loop holds them.
        parts.sort(key=_part_order)
        if not any(p.key.startswith("model") for p in parts):
            raise BadInputError(
                "holds no model (pytorch_model_fsdp_0/, pytorch_model_fsdp.bin or model.safetensors)",
                path=self.src,
                hint=f"pass the directory Accelerator.save_state wrote, or {SRC_FORMAT} another format",
            )
        return parts, carried

    def kept(self, name: str) -> bool:
        # What save_state writes and shardckpt carries; anything else beside it is the user's.
        return any(p.fullmatch(name) for p, _ in _CARRIED) or bool(_VALUE_FILE.fullmatch(name))

    def _dcp(self, path: Path) -> DcpReader:
        return DcpReader(path, self.trust_pickle)

    def _file(self, path: Path):
        if path.suffix == ".safetensors":
            return SafetensorsReader(path, self.trust_pickle)
        return TorchReader(path, self.trust_pickle)

    def world_size(self, indexes: dict[str, Index]) -> int | None:
        # A DCP part knows the job's world size; a full save's files do not, but every
        # rank wrote its own RNG file.
        sharded = [i.world_size for i in indexes.values() if i.format == "dcp" and i.world_size]
        if sharded:
            return max(sharded)
        ranks = [int(m.group(1)) for p in self.carried if (m := RNG_FILE.fullmatch(p.file))]
        return max(ranks) + 1 if ranks else None


def world_size_note(names: list[str], world_size: int) -> str | None:
    """Return the note on per-rank files of ``names`` that do not fit a job of ``world_size``."""
    ranks = {int(m.group(1)) for n in names if (m := RNG_FILE.fullmatch(n))}
    if not ranks:
        return None
    extra = sorted(r for r in ranks if r >= world_size)
    missing = [r for r in range(world_size) if r not in ranks]
    said = []
    if extra:
        files = ", ".join(f"random_states_{r}.pkl" for r in extra)
        whose = "a rank" if len(extra) == 1 else "ranks"
        said.append(f"{files} copied unchanged, for {whose} a job of {world_size} does not have")
    if missing:
        which = ", ".join(map(str, missing))
        whose = f"rank {which}" if len(missing) == 1 else f"ranks {which}"
        said.append(
            f"no random_states file for {whose} of {world_size}: accelerate's load_state "
            "leaves that RNG as it is"
        )
    return "; ".join(said) if said else None


class AccelerateWriter(PartsWriter):
    """A ``save_state`` directory at M: SHARDED_STATE_DICT DCP parts, other files copied."""

    def subcheckpoints(self, plan) -> list[SubCheckpoint]:
        subs: dict[str, SubCheckpoint] = {}
        from_files = {p.key for p in plan.parts if p.key is not None and p.format != "dcp"}
        # An optimizer under another key (``optim``) is the job's i-th in tree order.
        optimizers = [k for k, tree in plan.tree.items() if is_optimizer(tree)]
        for key, tree in plan.tree.items():
            if (i := _index_of(key, "model")) is not None:
                sub = SubCheckpoint(f"pytorch_model_fsdp_{i}", "dcp", DcpWriter, {"model": tree})
            elif is_optimizer(tree):
                i = _index_of(key, "optimizer")
                i = optimizers.index(key) if i is None else i
                sub = SubCheckpoint(f"optimizer_{i}", "dcp", DcpWriter, {"optimizer": tree})
            elif key in from_files:
                continue  # copied as it is
            else:
                raise UsageError(
                    f"--format accelerate holds models, optimizers and the files of an "
                    f"accelerate directory, and top-level key {key!r} is none of them",
                    hint="--filter it out, or write --format dcp",
                )
            if sub.dir in subs:
                raise UsageError(
                    f"--format accelerate: two top-level keys would both be written to "
                    f"{sub.dir}/ ({key!r} and the one before it)",
                    hint="--filter one of them out, or write --format dcp",
                )
            subs[sub.dir] = sub
        if not subs:
            raise UsageError(
                "--format accelerate: nothing selected is a model or an optimizer",
                hint="check --only and --filter against `shardckpt inspect`",
            )
        return list(subs.values())

    def copies(self, plan) -> list[tuple[Path, str]]:
        src = Path(plan.src)
        return [
            (src / p.file, p.file)
            for p in plan.parts
            if p.key is None
            or (p.key in plan.tree and p.format != "dcp" and not _holds_tensors(p.key))
        ]

    def finish(self) -> None:
        super().finish()
        # Said on the coordinator, once, when the output is complete.
        note = world_size_note([name for _, name in self.copied], self.plan.world_size)
        if note:
            notice(note)


def _holds_tensors(key: str) -> bool:
    """Return whether part ``key`` is a model or an optimizer (written, not copied)."""
    return _index_of(key, "model") is not None or _index_of(key, "optimizer") is not None


def _part_order(part: Part) -> tuple[int, int]:
    """Return where ``part`` goes in the tree: models, then optimizers (by index), then the rest."""
    for kind, name in enumerate(("model", "optimizer")):
        if (i := _index_of(part.key, name)) is not None:
            return kind, i
    return 2, 0


def _index_of(key: object, name: str) -> int | None:
    """Return i for key ``name`` (0) or ``name_i``; None for any other key."""
    if key == name:
        return 0
    m = re.fullmatch(rf"{name}_(\d+)", str(key))
    return int(m.group(1)) if m else None
