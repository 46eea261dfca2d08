"""Checkpoint trees: paths, leaves, optimizer subtrees and FQN cleaning (pure, no I/O).

A checkpoint is a nested container. Its leaves are tensors (or ``TensorMeta`` stand-ins
while only metadata is known) and plain Python values. Paths follow DCP's own
traversal so every format names a leaf the same way: mappings are always entered,
lists only when they hold tensors or mappings, and everything else (tuples, lists of
plain values such as ``param_groups[i]["params"]``) is one value leaf. An empty mapping
below the root is a leaf too, the value ``{}``: an optimizer's ``state`` before its first
step is one, and a format that stores only leaves would otherwise lose it. FQNs contain
dots, so a path is a tuple and a dotted string is only ever for display.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from shardckpt.core.errors import BadInputError
from shardckpt.core.lazy_torch import is_tensor, torch
from shardckpt.state.plain_tensor import PlainTensor

PathItem = str | int
Path = tuple[PathItem, ...]


@dataclass(frozen=True)
class Chunk:
    """One stored piece of a tensor: who wrote it and where it sits in the whole."""

    rank: int | None
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class TensorMeta:
    """A tensor known by metadata only: the reader's key for it, shape, dtype and layout."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: str = "full"
    chunks: tuple[Chunk, ...] = field(default=(), compare=False)

    @property
    def numel(self) -> int:
        """Return the number of elements of the whole tensor."""
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        """Return the size of the whole tensor in bytes."""
        return self.numel * self.dtype.itemsize


def is_tensor_leaf(value: object) -> bool:
    """Return whether ``value`` is a tensor or a tensor's metadata (``TensorMeta``, ``PlainTensor``)."""
    return isinstance(value, (TensorMeta, PlainTensor)) or is_tensor(value)


def _enters(value: object) -> bool:
    """Return whether traversal goes into ``value`` (DCP's rule) instead of stopping at it."""
    if isinstance(value, Mapping):
        return True
    if not isinstance(value, list):
        return False
    return any(is_tensor_leaf(v) or (isinstance(v, (Mapping, list)) and _enters(v)) for v in value)


def _is_empty_mapping(tree: object, prefix: Path) -> bool:
    """Return whether ``tree`` is an empty mapping below the root: a leaf, the value ``{}``."""
    return bool(prefix) and isinstance(tree, Mapping) and not tree


def walk(tree: object, prefix: Path = ()) -> Iterator[tuple[Path, object]]:
    """Yield ``(path, leaf)`` for every leaf, in container order."""
    if _is_empty_mapping(tree, prefix):
        yield prefix, tree
    elif isinstance(tree, Mapping):
        for k, v in tree.items():
            yield from walk(v, prefix + (k,))
    elif prefix and _enters(tree):
        for i, v in enumerate(tree):  # type: ignore[arg-type]
            yield from walk(v, prefix + (i,))
    else:
        yield prefix, tree


def tensor_leaves(tree: object) -> list[tuple[Path, TensorMeta]]:
    """Return ``(path, meta)`` for every tensor leaf of ``tree``, in container order."""
    return [(p, leaf) for p, leaf in walk(tree) if isinstance(leaf, TensorMeta)]


def containers(tree: object, prefix: Path = ()) -> Iterator[tuple[Path, str]]:
    """Yield ``(path, "dict" | "list")`` for every container ``walk`` enters below the root."""
    if _is_empty_mapping(tree, prefix):
        return
    if isinstance(tree, Mapping):
        if prefix:
            yield prefix, "dict"
        for k, v in tree.items():
            yield from containers(v, prefix + (k,))
    elif prefix and _enters(tree):
        yield prefix, "list"
        for i, v in enumerate(tree):  # type: ignore[arg-type]
            yield from containers(v, prefix + (i,))


def map_leaves(tree: object, fn: Callable[[Path, object], object], prefix: Path = ()) -> object:
    """Return a copy of ``tree`` with every leaf replaced by ``fn(path, leaf)``."""
    if _is_empty_mapping(tree, prefix):
        return fn(prefix, {})
    if isinstance(tree, Mapping):
        return {k: map_leaves(v, fn, prefix + (k,)) for k, v in tree.items()}
    if prefix and _enters(tree):
        return [map_leaves(v, fn, prefix + (i,)) for i, v in enumerate(tree)]  # type: ignore[arg-type]
    return fn(prefix, tree)


_DROPPED = object()


def prune(tree: object, keep: Callable[[Path, object], bool], prefix: Path = ()) -> object:
    """Return ``tree`` without the leaves ``keep`` rejects; emptied containers go too."""
    if _is_empty_mapping(tree, prefix):
        return {} if keep(prefix, tree) else _DROPPED
    if isinstance(tree, Mapping):
        kept = {k: prune(v, keep, prefix + (k,)) for k, v in tree.items()}
        kept = {k: v for k, v in kept.items() if v is not _DROPPED}
        return kept if kept or not prefix else _DROPPED
    if prefix and _enters(tree):
        kept_list = [prune(v, keep, prefix + (i,)) for i, v in enumerate(tree)]  # type: ignore[arg-type]
        kept_list = [v for v in kept_list if v is not _DROPPED]
        return kept_list if kept_list else _DROPPED
    return tree if keep(prefix, tree) else _DROPPED


def build(items: list[tuple[Path, object]]) -> dict:
    """Return the tree whose leaves are ``items``: str keys make dicts, int keys lists (DCP's rule)."""
    root: dict = {}
    for path, value in items:
        node: Any = root
        for here, nxt in zip(path, path[1:]):
            empty: Any = [] if isinstance(nxt, int) else {}
            if isinstance(node, list):
                while len(node) <= here:
                    node.append(None)
                if node[here] is None:
                    node[here] = empty
                node = node[here]
            else:
                node = node.setdefault(here, empty)
        last = path[-1]
        if isinstance(node, list):
            while len(node) <= last:
                node.append(None)
        node[last] = value
    return root


def dotted(path: Path) -> str:
    """Return the display form of ``path`` (``model.layers.0.weight``); never parsed back."""
    return ".".join(str(p) for p in path)


def path_to_json(path: Path) -> list[PathItem]:
    """Return ``path`` as a JSON list (str keys, int list indices)."""
    return list(path)


# ---------------------------------------------------------------- optimizer subtrees


# Where torch (2.5 and later) keeps, in each param group of an optimizer built from
# ``named_parameters()``, the name of each parameter in ``params`` order.
PARAM_NAMES = "param_names"


@dataclass(frozen=True)
class OptimizerInfo:
    """What an optimizer subtree holds: key type, parameters, state names, groups."""

    path: Path
    key_type: str  # "fqn", "id" or "empty"
    num_params: int
    state_names: tuple[str, ...]
    num_groups: int
    param_names: bool = False
    """Whether every param group stores its parameters' names (``PARAM_NAMES``)."""


def is_nested_optimizer(node: object) -> bool:
    """Return whether ``node`` is an optimizer state dict as ``torch.optim`` nests it (``state`` + ``param_groups``)."""
    return isinstance(node, Mapping) and "state" in node and "param_groups" in node


# torch's flattened optimizer form (``get_state_dict`` with ``flatten_optimizer_state_dict``,
# torchtitan's optimizer): ``state.<fqn>.<name>`` and ``param_groups.<fqn>.<hyper-parameter>``,
# the hyper-parameters of a parameter's group repeated for every parameter.
FLAT_STATE = "state."
FLAT_GROUPS = "param_groups."


def is_flat_optimizer(node: object) -> bool:
    """Return whether ``node`` is an optimizer state dict in torch's flattened form.

    Every key starts with ``state.`` or ``param_groups.``, at least one with the latter
    (a parameter always has its group's hyper-parameters, state only after a step), and
    no value is a non-empty mapping (flattening leaves none).
    """
    if not isinstance(node, Mapping) or not node:
        return False
    return all(
        isinstance(k, str)
        and k.startswith((FLAT_STATE, FLAT_GROUPS))
        and not (isinstance(v, Mapping) and v)
        for k, v in node.items()
    ) and any(k.startswith(FLAT_GROUPS) for k in node)


def is_optimizer(node: object) -> bool:
    """Return whether ``node`` is an optimizer state dict, nested or flattened."""
    return is_nested_optimizer(node) or is_flat_optimizer(node)


class FlatKey(NamedTuple):
    """A key of a flattened optimizer, parsed: its section, the parameter's FQN, the name after it.

    A tuple, not a dataclass: a flattened optimizer has several keys per parameter, and
    every one is parsed.
    """

    section: str
    """``state`` or ``param_groups``."""
    fqn: str | None
    """None for a state key that names no parameter of ``param_groups``."""
    name: str
    """The state name (dotted for nested state) or hyper-parameter; the whole rest when ``fqn`` is None."""

    def key(self, fqn: str | None = None) -> str:
        """Return the flattened key, with ``fqn`` in place of this one's when given."""
        fqn = fqn if fqn is not None else self.fqn
        return (
            f"{self.section}.{fqn}.{self.name}"
            if fqn is not None
            else f"{self.section}.{self.name}"
        )


def parse_flat(node: Mapping) -> dict[str, FlatKey]:
    """Return every key of a flattened optimizer, parsed.

    FQNs hold dots, so a key is never split blindly: the FQNs are those of the
    ``param_groups.<fqn>.<hyper-parameter>`` keys (hyper-parameter names hold no dots),
    and a state key belongs to the longest of them it starts with, as torch's own
    unflattening looks state up by each parameter's FQN.
    """
    groups = len(FLAT_GROUPS)
    hyper = {
        key: FlatKey("param_groups", *key[groups:].rpartition(".")[::2])
        for key in node
        if key.startswith(FLAT_GROUPS)
    }
    fqns = {p.fqn for p in hyper.values()}
    out: dict[str, FlatKey] = {}
    for key in node:
        if key in hyper:
            out[key] = hyper[key]
            continue
        rest = key[len(FLAT_STATE) :]
        dot = rest.rfind(".")
        while dot > 0 and rest[:dot] not in fqns:
            dot = rest.rfind(".", 0, dot)
        out[key] = (
            FlatKey("state", rest[:dot], rest[dot + 1 :])
            if dot > 0
            else FlatKey("state", None, rest)
        )
    return out


def flat_hyperparameters(
    node: Mapping, parsed: Mapping[str, FlatKey] | None = None
) -> dict[str, dict[str, object]]:
    """Return each parameter's hyper-parameters in a flattened optimizer, in key order.

    ``parsed`` is ``parse_flat(node)`` when the caller has it already.
    """
    out: dict[str, dict[str, object]] = {}
    for key, p in (parsed if parsed is not None else parse_flat(node)).items():
        if p.section == "param_groups":
            out.setdefault(p.fqn, {})[p.name] = node[key]  # type: ignore[index]
    return out


def _value_key(value: object) -> object:
    """Return what makes two hyper-parameter values equal: type and exact repr (``-0.0`` is not ``0.0``)."""
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_value_key(v) for v in value))
    return (type(value).__name__, repr(value))


def hyperparameter_key(values: Mapping[str, object]) -> tuple:
    """Return what makes two parameters' hyper-parameters equal: names in order, exact values."""
    return tuple((k, _value_key(v)) for k, v in values.items())


def groups_by_value(hyper: Mapping[str, Mapping[str, object]]) -> list[list[str]]:
    """Return the FQNs grouped by equal hyper-parameters (names and values), in order of first appearance."""
    groups: dict[object, list[str]] = {}
    for fqn, values in hyper.items():
        groups.setdefault(hyperparameter_key(values), []).append(fqn)
    return list(groups.values())


def find_optimizers(tree: object, prefix: Path = ()) -> list[Path]:
    """Return the paths of every optimizer subtree, outermost first."""
    if is_optimizer(tree):
        return [prefix]
    if isinstance(tree, Mapping):
        return [p for k, v in tree.items() for p in find_optimizers(v, prefix + (k,))]
    return []


def subtree(tree: object, path: Path) -> object:
    """Return the node at ``path``."""
    node: Any = tree
    for p in path:
        node = node[p]
    return node


def param_id(key: object) -> int | None:
    """Return ``key`` as a param ID (``3``, or DCP's ``"3"``), or None when it is an FQN."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    # DCP stores every mapping key as str, so ID-keyed state comes back as "0", "1", ...
    if isinstance(key, str) and key.isdigit():
        return int(key)
    return None


def optimizer_key_type(keys: list) -> str:
    """Return ``"id"``, ``"fqn"`` or ``"empty"`` for an optimizer's state keys and params."""
    if not keys:
        return "empty"
    return "id" if all(param_id(k) is not None for k in keys) else "fqn"


def describe_optimizer(tree: object, path: Path) -> OptimizerInfo:
    """Return the summary of the optimizer subtree at ``path``.

    A flattened one has key type ``flat``; its groups are its parameters grouped by
    equal hyper-parameters, as converting it to the nested form groups them.
    """
    node: Any = subtree(tree, path)
    if is_flat_optimizer(node):
        parsed = parse_flat(node)
        names = sorted(
            {k.name for k in parsed.values() if k.section == "state" and k.fqn is not None}
        )
        hyper = flat_hyperparameters(node, parsed)
        return OptimizerInfo(path, "flat", len(hyper), tuple(names), len(groups_by_value(hyper)))
    state = node["state"] if isinstance(node["state"], Mapping) else {}
    groups = node["param_groups"] if isinstance(node["param_groups"], list) else []
    params = [p for g in groups if isinstance(g, Mapping) for p in g.get("params", [])]
    key_type = optimizer_key_type(list(state.keys()) + params)
    names = sorted({n for s in state.values() if isinstance(s, Mapping) for n in s})
    named = bool(groups) and all(isinstance(g, Mapping) and PARAM_NAMES in g for g in groups)
    return OptimizerInfo(
        path, key_type, len(params) or len(state), tuple(names), len(groups), named
    )


def split_model_optim(tree: Mapping, only: str) -> dict:
    """Return the top level of ``tree`` restricted to ``only`` (all, model or optim)."""
    if only == "all":
        return dict(tree)
    want_optim = only == "optim"
    out = {}
    for k, v in tree.items():
        if is_optimizer(v) == want_optim:
            out[k] = v
        elif isinstance(v, Mapping) and not is_optimizer(v) and want_optim:
            inner = split_model_optim(v, only)
            if inner:
                out[k] = inner
    return out


# ---------------------------------------------------------------- FQN cleaning

_WRAPPER_PARTS = re.compile(r"(?:_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod)\.")
_DDP_PREFIX = "module."


def clean_fqn(fqn: str) -> str:
    """Return ``fqn`` without FSDP/checkpoint/compile wrapper parts and a DDP ``module.`` prefix."""
    fqn = _WRAPPER_PARTS.sub("", fqn)
    return fqn[len(_DDP_PREFIX) :] if fqn.startswith(_DDP_PREFIX) else fqn


def rename_keys(tree: object, rename: Callable[[str], str], prefix: Path = ()) -> object:
    """Return ``tree`` with ``rename`` applied to str mapping keys and optimizer ``params`` lists.

    An optimizer's ``param_names`` lists are FQNs too, renamed alike.

    In a flattened optimizer only the FQN inside each key is renamed. Raises
    ``KeyError`` naming both originals when two keys of one mapping collide.
    """
    if is_flat_optimizer(tree):
        return rename_flat(tree, rename, prefix)  # type: ignore[arg-type]
    if isinstance(tree, Mapping):
        out: dict = {}
        origin: dict = {}
        for k, v in tree.items():
            nk = rename(k) if isinstance(k, str) else k
            if nk in out:
                raise KeyError((dotted(prefix + (origin[nk],)), dotted(prefix + (k,)), nk))
            origin[nk] = k
            if (
                k in ("params", PARAM_NAMES)
                and isinstance(v, list)
                and all(isinstance(p, str) for p in v)
            ):
                out[nk] = [rename(p) for p in v]
            else:
                out[nk] = rename_keys(v, rename, prefix + (k,))
        return out
    if prefix and _enters(tree):
        return [rename_keys(v, rename, prefix + (i,)) for i, v in enumerate(tree)]  # type: ignore[arg-type]
    return tree


def rename_flat(node: Mapping, rename: Callable[[str], str | None], prefix: Path = ()) -> dict:
    """Return a flattened optimizer with ``rename`` applied to the FQN in each key, order kept.

    A None from ``rename`` drops every key of that parameter; a key that names no
    parameter is kept as it is. Raises ``KeyError`` naming both originals on a collision.
    """
    out: dict = {}
    origin: dict = {}
    for key, parsed in parse_flat(node).items():
        if parsed.fqn is None:
            new_key: str | None = key
        else:
            fqn = rename(parsed.fqn)
            new_key = parsed.key(fqn) if fqn is not None else None
        if new_key is None:
            continue
        if new_key in out:
            raise KeyError((dotted(prefix + (origin[new_key],)), dotted(prefix + (key,)), new_key))
        origin[new_key] = key
        out[new_key] = node[key]
    return out


# ---------------------------------------------------------------- model state


def model_prefix(tree: Mapping) -> Path:
    """Return where the model state sits: ``("model",)`` when the top level has one, else ``()``."""
    node = tree.get("model")
    return ("model",) if isinstance(node, Mapping) and not is_optimizer(node) else ()


def model_leaves(tree: Mapping) -> list[tuple[Path, object]]:
    """Return ``(path, leaf)`` of the model state: under ``model`` if present, else outside optimizers.

    Checkpoints written by training loops hold ``{"model": ..., "optim": ...}``; other
    entries beside ``model`` (epoch counters, schedulers, RNG state) are not model state.
    """
    prefix = model_prefix(tree)
    optimizers = find_optimizers(tree)
    return [
        (path, leaf)
        for path, leaf in walk(tree)
        if path[: len(prefix)] == prefix and not any(path[: len(o)] == o for o in optimizers)
    ]


def too_deep(path: str | os.PathLike) -> BadInputError:
    """Return the error for a source whose tree nests deeper than Python's recursion allows."""
    return BadInputError(
        "its tree of dicts and lists is nested too deeply to walk",
        path=path,
        hint="shardckpt reads trees a few hundred levels deep; this one was not written "
        "by a training job",
    )
