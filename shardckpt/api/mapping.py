"""``--map``: a source read through an architecture mapping (``plan.mapping``), chosen, sized and proven.

Which mapping: ``--map NAME|FILE.toml``; without it, for an ``hf`` output, the shipped
mapping for SRC's format and ``--hf-config``'s ``architectures`` that names most of SRC's weights
(said once). Which way: SRC in one of the mapping's source formats is mapped to Hugging
Face's names; an ``hf`` or ``safetensors`` SRC is mapped back. Sizes come from
``--hf-config``'s ``config.json``, or, mapping back, SRC's own.

``--rename``/``--drop`` act on SRC's names before the mapping (a drop is the one way to
leave a tensor out, counted in the ledger); ``--filter`` and ``--only optim``, which
would act on the mapped names, are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from shardckpt.core.errors import UsageError, notice
from shardckpt.core.words import counted
from shardckpt.formats.base import Reader
from shardckpt.formats.hf.config import CONFIG_FILE, HfConfig, config_in, hf_config
from shardckpt.formats.trainers.megatron import model_args as megatron_args
from shardckpt.formats.trainers.megatron.config import COMMON_FILE
from shardckpt.plan.mapping import layout, rules
from shardckpt.plan.mapping.reader import MappedReader
from shardckpt.plan.selection import Selection
from shardckpt.state.tree import TensorMeta, model_prefix, tensor_leaves

_HF_SOURCES = ("hf", "safetensors")
_SIZED_SOURCES = ("megatron",)
"""Formats whose checkpoints store their model arguments (Megatron-LM's ``args`` in ``common.pt``)."""


@dataclass(frozen=True)
class MappedSource:
    """SRC read through a mapping: the reader, and the summary the JSON document holds."""

    reader: Reader
    summary: dict
    made_config: HfConfig | None = None
    """The ``config.json`` made from SRC's own model arguments (Megatron's ``args``), DST's."""


def mapped_source(
    reader: Reader,
    *,
    spec: str | None,
    output: str,
    companions: HfConfig | None,
    selection: Selection,
    coordinator: bool,
) -> MappedSource | None:
    """Return ``reader`` read through the mapping ``spec`` names (or the one chosen); None for none."""
    if spec is None and (
        output != "hf"
        or (companions is None and reader.format not in _SIZED_SOURCES)
        or not rules.maps_from(reader.format)
    ):
        return None  # no mapping can be chosen: SRC's index is not read here
    index = reader.index()
    prefix = model_prefix(index.tree)
    weights: dict[str, TensorMeta] = {}
    others = 0
    for path, meta in tensor_leaves(index.tree):
        if path[: len(prefix)] == prefix and len(path) == len(prefix) + 1:
            weights[str(path[-1])] = meta
        else:
            others += 1
    made = None
    if output == "hf" and companions is None:
        made = _made_config(reader, index.tree, weights)
    companions = companions or made
    if spec is None and companions is None:
        return None
    amap = _mapping(spec, output, reader.format, companions, weights, coordinator)
    if amap is None:
        return None
    _refuse_selection(selection, amap)
    backward = reader.format in _HF_SOURCES and reader.format not in amap.sources
    if not backward and reader.format not in amap.sources:
        raise UsageError(
            f"--map {amap.name}: maps the names of {', '.join(amap.sources)} checkpoints and "
            f"Hugging Face's, and SRC is {reader.format}",
            path=reader.src,
            hint="pass the --map of SRC's architecture and trainer",
        )
    config, where = _sizes_config(amap, companions, reader, backward)
    sizes = amap.sizes_from(config, where)
    untied = amap
    amap = amap.for_config(config)
    kept, dropped = _edited(weights, selection, str(reader.src))
    tied = _tied_names(untied, amap, kept) if backward else {}
    if coordinator and tied:
        notice(
            f"leaving SRC's {', '.join(repr(n) for n in tied)} out: its config ties "
            f"{'them' if len(tied) > 1 else 'it'} to the embedding, as from_pretrained does"
        )
    apply = layout.backward if backward else layout.forward
    mapped = apply(amap, sizes, kept, str(reader.src))
    tree = {"model": dict(mapped.metas)} if output == "hf" else dict(mapped.metas)
    if coordinator and others:
        notice(
            f"mapping SRC's model weights with '{amap.name}': its other "
            f"{counted(others, 'tensor')} (optimizer and trainer state) are not in DST"
        )
    ledger = layout.Ledger(
        tensors_in=len(weights),
        bytes_in=sum(m.nbytes for m in weights.values()),
        tensors_out=len(mapped.metas),
        bytes_out=sum(m.nbytes for m in mapped.metas.values()),
        dropped=(*dropped, *tied),
        bytes_dropped=sum(weights[n].nbytes for n in dropped)
        + sum(m.nbytes for m in tied.values()),
    )
    summary = {
        "name": amap.name,
        "file": str(amap.file),
        "direction": "from hf" if backward else "to hf",
        **ledger.as_json(),
    }
    reader = MappedReader(reader, mapped, kept, tree, index.world_size)
    return MappedSource(reader, summary, made)


def _tied_names(
    untied: rules.ArchMap, tied: rules.ArchMap, kept: dict[str, TensorMeta]
) -> dict[str, TensorMeta]:
    """Take out of ``kept`` (Hugging Face names) those of the rules the config's flags left out; return them.

    A tied model's ``lm_head.weight`` is the embedding: ``save_pretrained`` leaves it out
    (the reader gives it back, as ``from_pretrained`` does), and a trainer that ties
    stores no output layer for it to become.
    """
    left_out = [rule for rule in untied.rules if rule not in tied.rules]
    patterns = [rules.pattern(r, "target", i) for r in left_out for i in range(len(r.targets))]
    names = [n for n in kept if any(p.fullmatch(n) for p in patterns)]
    return {n: kept.pop(n) for n in names}


def _said_by(companions: HfConfig) -> Path:
    """Return the file ``companions``' config was read from: ``config.json``, or Megatron's ``common.pt``."""
    return companions.root / (COMMON_FILE if companions.made else CONFIG_FILE)


def _made_config(
    reader: Reader, tree: Mapping, weights: Mapping[str, TensorMeta]
) -> HfConfig | None:
    """Return the ``config.json`` SRC's own model arguments describe, when it stores them (Megatron's ``args``)."""
    if reader.format not in _SIZED_SOURCES or tree.get("args") is None:
        return None
    embedding = weights.get(megatron_args.EMBEDDING)
    shape = embedding.shape if embedding is not None else None
    config = megatron_args.hf_config(tree["args"], reader.src / COMMON_FILE, shape)
    return HfConfig(reader.src, (CONFIG_FILE,), detected=False, config=config, made=True)


def _mapping(
    spec: str | None,
    output: str,
    src_format: str,
    companions: HfConfig | None,
    weights: Mapping[str, TensorMeta],
    coordinator: bool,
) -> rules.ArchMap | None:
    """Return the mapping ``--map`` names, else the one chosen for an ``hf`` output, else None."""
    if spec is not None:
        return rules.load(spec)
    if output != "hf" or companions is None:
        return None
    amap = rules.chosen(src_format, companions.config.get("architectures"), weights)
    if amap is not None and coordinator:
        notice(
            f"mapping SRC's names to Hugging Face's with '{amap.name}', chosen by SRC's format "
            f"and '{_said_by(companions)}' (pass --map to name another)"
        )
    return amap


def _refuse_selection(selection: Selection, amap: rules.ArchMap) -> None:
    """Refuse what would act on the mapped names: ``--filter``, ``--only optim``, ``--nest``/``--unnest``."""
    for option, given in (
        ("--filter", bool(selection.filters)),
        ("--only optim", selection.only == "optim"),
        ("--nest", selection.nest is not None),
        ("--unnest", selection.unnest is not None),
    ):
        if given:
            raise UsageError(
                f"{option} does not go with --map {amap.name}: a mapping maps every model "
                "weight, and its coverage proof counts each",
                hint="leave a source tensor out with --drop REGEX (counted in the ledger)",
            )


def _sizes_config(
    amap: rules.ArchMap, companions: HfConfig | None, reader: Reader, backward: bool
) -> tuple[Mapping, str]:
    """Return the ``config.json`` sizes are read from, and its path for messages."""
    if companions is not None:
        return companions.config, str(_said_by(companions))
    found = config_in(reader.src) if backward else None
    if found is not None:
        config = hf_config(found, detected=True)
        return config.config, str(config.root / CONFIG_FILE)
    raise UsageError(
        f"--map {amap.name} needs the model's sizes ({', '.join(amap.sizes)}), and "
        f"{'SRC holds no config.json' if backward else 'SRC does not store them'}",
        path=reader.src,
        hint="pass --hf-config DIR, the directory of the model's config.json",
    )


def _edited(
    weights: Mapping[str, TensorMeta], selection: Selection, src: str
) -> tuple[dict[str, TensorMeta], list[str]]:
    """Return SRC's weights renamed by ``--rename`` (by their new names), and the names ``--drop`` dropped."""
    edits = selection.fqn_map(src)
    if edits is None:
        return dict(weights), []
    edits.plan([(name, ()) for name in weights])
    kept: dict[str, TensorMeta] = {}
    dropped = []
    for name, meta in weights.items():
        new = edits(name, ())
        if new is None:
            dropped.append(name)
        else:
            kept[new] = meta
    return kept, dropped


def without_edits(selection: Selection) -> Selection:
    """Return ``selection`` with ``--rename``/``--drop`` taken out: the mapping applied them to SRC's names."""
    return replace(selection, edits=())
