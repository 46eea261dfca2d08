"""The tree of a DeepSpeed checkpoint: ``model``, ``optim`` in torch's FQN-keyed form, the job's values.

Built from the model-states files and, for each trainable parameter, where its fp32
master weights and optimizer state are read (``Trainable``: the flat partitions of a
ZeRO save, or the per-parameter files of a universal one). ``model`` holds the module's
entries in the module's order, as ``zero_to_fp32`` consolidates them: trainable
parameters as their fp32 master, frozen parameters as saved (ZeRO-2/3:
``frozen_param_fragments``; ZeRO-1, which saves none: the module's own), floating
buffers in fp32, and a tied parameter as the one it is tied to, under its own name.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shardckpt.core.errors import BadInputError
from shardckpt.formats.base import Rows
from shardckpt.formats.trainers.deepspeed.sources import Source, Span, Spans, Whole
from shardckpt.formats.trainers.deepspeed.states import ModelStates
from shardckpt.state.tree import TensorMeta, map_leaves

MASTER = "master"
"""``model`` is the fp32 master weights (what ``zero_to_fp32`` gives)."""
MODULE = "module"
"""``model`` is the module's own state dict as saved (16-bit weights in a bf16/fp16 run)."""
REPLICATED = "replicated"
"""The layout of a parameter every rank held whole: not ``full``, which a sharded or local
output keeps whole (buffers), for FSDP shards parameters, frozen ones too."""


@dataclass(frozen=True)
class Stored:
    """A tensor of the checkpoint: where it is read, its shape, dtype and how it is stored."""

    source: Source
    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: str
    """How ``inspect`` describes where it is stored (``ZeRO-2 flat over 2``, ``full``)."""


@dataclass(frozen=True)
class Trainable:
    """A parameter the optimizer trained: where its fp32 master and its state are read."""

    fqn: str
    group: int
    """Its param group of the optimizer."""
    master: Stored
    states: dict
    """Its optimizer state by name (``exp_avg``, ``step``, ...): ``Stored``, or a plain value."""


@dataclass
class Sources:
    """The tensors of a tree as ``TensorMeta`` leaves, each with the source it is read from."""

    by_key: dict[str, Source] = field(default_factory=dict)

    def add(
        self, source: Source, shape: Sequence[int], dtype: torch.dtype, layout: str
    ) -> TensorMeta:
        """Return a new leaf read from ``source``."""
        key = str(len(self.by_key))
        self.by_key[key] = source
        return TensorMeta(key, tuple(shape), dtype, layout)

    def read(self, metas: Sequence[TensorMeta], rows: Sequence[Rows]) -> list[torch.Tensor]:
        """Return the rows asked of each leaf (``Reader.read``), from the source it is read from."""
        return [self.by_key[m.key].read(m, r) for m, r in zip(metas, rows)]

    def stored(self, stored: Stored) -> TensorMeta:
        """Return a new leaf for ``stored``."""
        return self.add(stored.source, stored.shape, stored.dtype, stored.layout)

    def whole(
        self, tensor: torch.Tensor, dtype: torch.dtype | None = None, layout: str = "full"
    ) -> TensorMeta:
        """Return a new leaf for a tensor saved whole (read in ``dtype`` when given)."""
        t = tensor.detach()
        return self.add(Whole(t), t.shape, dtype or t.dtype, layout)


def _fp32_if_floating(t: torch.Tensor) -> torch.dtype:
    """Return the dtype ``zero_to_fp32`` writes a tensor in: fp32 for a floating one."""
    return torch.float32 if t.is_floating_point() else t.dtype


def _frozen(models: Sequence[ModelStates], fqn: str, shape: tuple, sources: Sources) -> TensorMeta:
    """Return a frozen parameter (in fp32): whole (ZeRO-2), or each rank's ``ceil(numel / W)`` part (ZeRO-3)."""
    fragments = [m.frozen_fragments.get(fqn) for m in models]
    n = math.prod(shape)
    if len(models) == 1 and fragments[0] is not None and fragments[0].numel() == n:
        whole = fragments[0].reshape(shape)
        return sources.whole(whole, _fp32_if_floating(whole), REPLICATED)
    part = math.ceil(n / len(models))
    spans = []
    for rank, (model, frag) in enumerate(zip(models, fragments)):
        want = min(part, max(0, n - rank * part))
        if frag is None or frag.dim() != 1 or frag.numel() < want:
            got = "nothing" if frag is None else f"{frag.numel()} elements"
            raise BadInputError(
                f"frozen parameter '{fqn}' of shape {list(shape)} should have {want} elements "
                f"in this rank's file, but it has {got}",
                path=model.path,
                hint="the model-states files are not of one save; re-copy the checkpoint",
            )
        if want:
            spans.append(Span(frag.detach(), 0, rank * part, want))
    layout = f"ZeRO-3 over {len(models)}"
    return sources.add(Spans(tuple(spans)), shape, _fp32_if_floating(fragments[0]), layout)


def _placeholder(model: ModelStates, fqn: str, value: torch.Tensor) -> BadInputError:
    return BadInputError(
        f"'{fqn}' is a placeholder of {value.numel()} elements, and no metadata of the save says "
        "where its data is",
        path=model.path,
        hint="the model-states files are not of one save; re-copy the checkpoint",
    )


def model_tree(
    models: Sequence[ModelStates],
    trainables: Sequence[Trainable],
    sources: Sources,
    placeholders: bool,
    notes: list[str] | None = None,
) -> dict:
    """Return ``model`` as ``zero_to_fp32`` consolidates it, in the module's order.

    ``models`` are the model-states files (one, or each rank's for ZeRO-3); with
    ``placeholders`` (ZeRO-3) the module's parameters are placeholders, never read.
    What ``inspect`` should say about it is appended to ``notes``.
    """
    first = models[0]
    trained = {t.fqn: t for t in trainables}
    frozen = dict(first.frozen_shapes)
    tree: dict = {}
    aliases = {}
    from_module = []
    names = list(first.module) + [n for n in [*trained, *frozen] if n not in first.module]
    for fqn in names:
        value = first.module.get(fqn)
        if fqn in trained:
            tree[fqn] = sources.stored(trained[fqn].master)
        elif fqn in frozen:
            tree[fqn] = _frozen(models, fqn, frozen[fqn], sources)
        elif fqn in first.shared:
            aliases[fqn] = first.shared[fqn]
            tree[fqn] = None  # keeps the module's order; filled below
        elif not isinstance(value, torch.Tensor):
            tree[fqn] = value
        elif fqn in first.buffers:
            tree[fqn] = sources.whole(value, _fp32_if_floating(value))
        elif placeholders:
            raise _placeholder(first, fqn, value)
        else:
            # ZeRO-1 saves no frozen_param_shapes: its frozen parameters are the module's own.
            tree[fqn] = sources.whole(value, _fp32_if_floating(value), REPLICATED)
            from_module.append(fqn)
    _resolve_aliases(tree, aliases, sources, first.path)
    if from_module and notes is not None:
        notes.append(
            f"{len(from_module)} parameters outside the optimizer ({', '.join(from_module[:3])}"
            f"{', ...' if len(from_module) > 3 else ''}) are read from the module's state dict: "
            "a ZeRO-1 save lists no frozen parameters, and zero_to_fp32.py leaves them out"
        )
    return tree


def _resolve_aliases(tree: dict, aliases: dict[str, str], sources: Sources, path) -> None:
    """Fill each tied parameter's place in ``tree`` with a leaf read as the one it is tied to."""
    for alias, target in aliases.items():
        held = tree.get(target)
        if not isinstance(held, TensorMeta):
            raise BadInputError(
                f"'{alias}' is tied to '{target}', which the save does not hold",
                path=path,
                hint="the model-states file is damaged; re-copy the checkpoint",
            )
        tree[alias] = sources.add(sources.by_key[held.key], held.shape, held.dtype, held.layout)


def module_tree(model: ModelStates, sources: Sources) -> dict:
    """Return the module's state dict as saved: its own (16-bit, in a bf16/fp16 run) weights and buffers."""
    tree = {}
    for fqn, value in model.module.items():
        if not isinstance(value, torch.Tensor):
            tree[fqn] = value
        else:
            tree[fqn] = sources.whole(value, layout="full" if fqn in model.buffers else REPLICATED)
    return tree


def optim_tree(trainables: Sequence[Trainable], hypers: Sequence[dict], sources: Sources) -> dict:
    """Return the optimizer in torch's FQN-keyed form: ``state`` by FQN, ``param_groups`` with FQNs."""
    state: dict = {}
    groups = [{**{k: v for k, v in h.items() if k != "params"}, "params": []} for h in hypers]
    for t in trainables:
        groups[t.group]["params"].append(t.fqn)
        entry = {
            name: sources.stored(value) if isinstance(value, Stored) else value
            for name, value in t.states.items()
        }
        if entry:
            state[t.fqn] = entry
    return {"state": state, "param_groups": groups}


def job_values(model: ModelStates, scaler: dict, sources: Sources) -> dict:
    """Return the job's state beside the model and optimizer, as plain values (tensors in it as leaves)."""
    values = {k: v for k, v in model.job.items() if v is not None}
    if scaler:
        values["loss_scaler"] = dict(scaler)
    if model.client:
        values["client_state"] = dict(model.client)

    def leaf(_path: tuple, value: object) -> object:
        return sources.whole(value) if isinstance(value, torch.Tensor) else value

    return map_leaves(values, leaf)  # type: ignore[return-value]
