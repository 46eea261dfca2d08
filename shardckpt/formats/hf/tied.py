"""Tied weights of an ``hf`` source: the names ``save_pretrained`` leaves out, read as the model holds them.

``save_pretrained`` of a model whose weights are tied (``tie_word_embeddings``: a
language model's ``lm_head.weight`` is its ``model.embed_tokens.weight``) writes the
tensor once, under the name it is tied to. The model's state dict, and so FSDP2's DCP
of it, holds both names; a DCP written without one fails ``dcp.load`` ("Missing key in
checkpoint state_dict"). Read as an ``hf`` source, such a directory gives each tied name
back, read from the weight it is tied to.

Which ties: those of the ``config.json`` in SRC (the directory's own description of its
weights; ``--hf-config`` describes DST, not SRC), as transformers builds its model on the
meta device (``all_tied_weights_keys``); with ``--model``, those of that model (the
state dict's other names of a parameter), for a directory without ``config.json``.
A name the files hold is read from the files, never replaced.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from shardckpt.core.errors import ShardckptError
from shardckpt.core.files import has_file
from shardckpt.core.lazy_torch import torch
from shardckpt.formats.hf.config import (
    CONFIG_FILE,
    Expected,
    HfConfig,
    OutOfProportion,
    build_limit,
    expected_names,
    read_config,
)
from shardckpt.state.model import load_factory
from shardckpt.state.tree import TensorMeta, clean_fqn


def source_ties(root: Path, metas: Mapping[str, TensorMeta]) -> dict[str, str] | str:
    """Return the tied names ``metas`` (a directory's tensors) lack, each with the name it is tied to.

    From ``root``'s ``config.json``; none without one, or when it says
    ``tie_word_embeddings: false``. When it says ``true`` and its model cannot be built,
    why, as a note: the tied weights cannot be given back.
    """
    if not has_file(root / CONFIG_FILE, root):
        return {}
    try:
        config = HfConfig(root, (CONFIG_FILE,), True, read_config(root / CONFIG_FILE))
    except ShardckptError:
        return {}  # a config that does not parse describes nothing; the weights still read
    says = config.config.get("tie_word_embeddings")
    if says is False:
        return {}  # transformers' tie switch, off: nothing to build
    largest = max((m.numel for m in metas.values()), default=0)
    try:
        expected = expected_names(config, build_limit(len(metas)), largest, metas)
    except OutOfProportion as exc:
        expected = str(exc)
    if isinstance(expected, Expected):
        return _lacking(expected.tied, metas)
    if says is not True:
        return {}
    return (
        f"'{root / CONFIG_FILE}' ties the word embeddings, but which weights cannot be told "
        f"({expected}): a tied weight save_pretrained left out is not given back (pass "
        "convert --model pkg.module:factory)"
    )


def module_ties(spec: str, clean_fqns: bool = True) -> dict[str, str]:
    """Return the state dict's other names of the tied parameters of ``--model spec``, each with its first name."""
    try:
        with torch.device("meta"):
            built = load_factory(spec)()
    except Exception:  # noqa: BLE001 - the user's code, already run once by --model's check
        return {}
    module = built[0] if isinstance(built, tuple) else built
    name = clean_fqn if clean_fqns else str
    first: dict[int, str] = {}
    ties: dict[str, str] = {}
    for fqn, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first:
            ties[name(fqn)] = first[id(param)]
        else:
            first[id(param)] = name(fqn)
    return ties


def _lacking(ties: Mapping[str, str], metas: Mapping[str, TensorMeta]) -> dict[str, str]:
    """Return the ties whose name ``metas`` lacks and whose weight it holds."""
    return {name: source for name, source in ties.items() if name not in metas and source in metas}


def with_ties(metas: Mapping[str, TensorMeta], ties: Mapping[str, str]) -> dict[str, TensorMeta]:
    """Return ``metas`` with each tied name it lacks, shaped as the weight it is tied to."""
    out = dict(metas)
    for name, source in _lacking(ties, metas).items():
        out[name] = TensorMeta(name, metas[source].shape, metas[source].dtype)
    return out
