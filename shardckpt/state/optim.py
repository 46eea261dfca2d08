"""Optimizer state keys, pure: param IDs <-> FQNs, renames and drops (no I/O, no collectives).

Plain ``torch.optim`` keys ``state`` by integer param IDs, numbered group by group in
``param_groups[*]["params"]`` order; FSDP and DCP key it by FQNs and list FQNs in
``params``. Every function here takes and returns trees whose leaves may be tensors or
``TensorMeta``: only keys, list positions and shapes are looked at, never tensor data.
DCP stores every mapping key as str, so an ID may arrive as ``3`` or ``"3"``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from shardckpt.state.tree import (
    FLAT_GROUPS,
    FLAT_STATE,
    PARAM_NAMES,
    Path,
    dotted,
    find_optimizers,
    flat_hyperparameters,
    groups_by_value,
    hyperparameter_key,
    is_flat_optimizer,
    is_optimizer,
    is_tensor_leaf,
    optimizer_key_type,
    param_id,
    parse_flat,
    rename_flat,
    subtree,
)

# A rename that returns None drops the FQN. It is told where the parameter's tensor sits
# (the path ``inspect`` prints it under, less the FQN): ``("model",)`` for both
# ``model.w`` and the optimizer's state of ``w`` beside it, so both are renamed alike.
FqnMap = Callable[[str, Path], "str | None"]

# Inference gives up (and asks for --model) rather than explore more partial assignments.
MAX_INFERENCE_STATES = 200_000


class RekeyError(ValueError):
    """The optimizer state contradicts itself (stray state, a parameter listed twice)."""


class OrderError(RekeyError):
    """Which FQN each param ID is cannot be told without a guess; ``--model`` would tell."""


class GroupError(OrderError):
    """Which param group each parameter of a flattened optimizer is in cannot be told; ``--model`` would tell."""


@dataclass(frozen=True)
class ModelParams:
    """A model's parameters: FQNs in ``named_parameters()`` order, shapes, groups when known; its buffers."""

    fqns: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    groups: tuple[tuple[str, ...], ...] | None = None
    aliases: tuple[str, ...] = ()
    """The state dict's other names of tied parameters (``head.weight`` tied to ``embed.weight``)."""
    buffers: tuple[str, ...] = ()
    """The state dict's tensors that are not parameters: persistent buffers, which FSDP never shards."""


def key_type(optim: Mapping) -> str:
    """Return ``"id"``, ``"fqn"``, ``"flat"`` or ``"empty"`` for an optimizer state dict."""
    if is_flat_optimizer(optim):
        return "flat"
    return optimizer_key_type(
        [*optim["state"], *(p for g in optim["param_groups"] for p in g.get("params", []))]
    )


def _groups(optim: Mapping) -> list[list]:
    return [list(g.get("params", [])) for g in optim["param_groups"]]


def _with(
    optim: Mapping, state: dict, params: Sequence[list], names: Sequence[list] | None = None
) -> dict:
    """Return ``optim`` with new state and params lists; every other entry and key order kept.

    ``names`` (each group's FQNs in its new ``params`` order) replace the
    ``param_names`` of the groups that store them, so each name stays beside its ID.
    """
    groups = []
    for i, (g, p) in enumerate(zip(optim["param_groups"], params)):
        group = {**g, "params": p}
        if names is not None and PARAM_NAMES in g:
            group[PARAM_NAMES] = list(names[i])
        groups.append(group)
    return {**optim, "state": state, "param_groups": groups}


def fqns_to_ids(optim: Mapping, model: ModelParams | None = None) -> dict:
    """Return ``optim`` keyed by param ID, numbered as ``torch.optim`` does: group by group.

    Within a group, IDs follow the ``params`` list, or with ``model`` the model's order
    (its param groups, else ``named_parameters()``): FSDP1 without ``use_orig_params``
    lists FQNs in flat-parameter order, which no plain optimizer was built in.
    """
    groups = _groups(optim)
    if model is not None:
        groups = _in_model_order(groups, model)
    ids: dict[str, int] = {}
    for params in groups:
        for fqn in params:
            if fqn in ids:
                raise RekeyError(f"parameter '{fqn}' is listed twice in param_groups")
            ids[fqn] = len(ids)
    stray = [k for k in optim["state"] if k not in ids]
    if stray:
        raise RekeyError(f"optimizer state for '{stray[0]}' names no parameter in param_groups")
    state = {ids[k]: v for k, v in sorted(optim["state"].items(), key=lambda kv: ids[kv[0]])}
    return _with(optim, state, [[ids[f] for f in params] for params in groups], groups)


def _in_model_order(groups: list[list], model: ModelParams) -> list[list]:
    """Return each group's FQNs sorted by their position in ``model``."""
    order = [f for g in model.groups for f in g] if model.groups is not None else model.fqns
    position = {f: i for i, f in enumerate(order)}
    for params in groups:
        unknown = [f for f in params if f not in position]
        if unknown:
            raise OrderError(f"'{unknown[0]}' is in the optimizer state but not in the model")
    return [sorted(params, key=position.__getitem__) for params in groups]


def normalize_ids(optim: Mapping) -> dict:
    """Return an ID-keyed ``optim`` with int keys (DCP hands them back as ``"0"``, ``"1"``, ...)."""
    state = {param_id(k): v for k, v in optim["state"].items()}
    return _with(optim, state, [[param_id(p) for p in params] for params in _groups(optim)])


def stored_names(optim: Mapping) -> list[list[str]] | None:
    """Return each group's FQNs from the ``param_names`` torch stores beside the IDs, or None.

    torch (2.5 and later) keeps them in every group of an optimizer built from
    ``named_parameters()``, in ``params`` order, and in none of one built from bare
    parameters (it refuses a mix). Names that do not line up with the IDs are refused,
    not guessed around.
    """
    groups = optim["param_groups"]
    named = [g for g in groups if isinstance(g, Mapping) and PARAM_NAMES in g]
    if not named:
        return None
    if len(named) != len(groups):
        raise RekeyError(f"only {len(named)} of {len(groups)} param groups list {PARAM_NAMES}")
    out = []
    for i, g in enumerate(groups):
        names, params = g[PARAM_NAMES], g.get("params", [])
        if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise RekeyError(f"param group {i}'s {PARAM_NAMES} is not a list of names")
        if len(names) != len(params):
            raise RekeyError(
                f"param group {i} lists {len(params)} params but {len(names)} {PARAM_NAMES}"
            )
        out.append(list(names))
    return out


def ids_to_fqns(optim: Mapping, fqn_groups: Sequence[Sequence[str]]) -> dict:
    """Return ``optim`` keyed by FQN: the j-th ID of group g becomes ``fqn_groups[g][j]``."""
    groups = _groups(optim)
    sizes, want = [len(g) for g in groups], [len(g) for g in fqn_groups]
    if sizes != want:
        raise OrderError(
            f"the checkpoint's param groups have {sizes} parameters, the model's {want}"
        )
    names: dict[int, str] = {}
    for params, fqns in zip(groups, fqn_groups):
        for key, fqn in zip(params, fqns):
            pid = param_id(key)
            if pid is None or pid in names:
                raise RekeyError(f"param ID {key!r} is not a unique integer in param_groups")
            names[pid] = fqn
    if len(set(names.values())) != len(names):
        raise OrderError("the model lists one parameter in two param groups")
    state = {}
    for key, value in sorted(optim["state"].items(), key=lambda kv: _position(kv[0], names)):
        pid = param_id(key)
        if pid not in names:
            raise RekeyError(f"optimizer state for param ID {key!r} is in no param group")
        state[names[pid]] = value
    return _with(optim, state, [list(f) for f in fqn_groups], fqn_groups)


def _position(key: object, names: Mapping[int, str]) -> int:
    """Return where ``key`` sorts: in ID order, unknown IDs last (they are reported)."""
    pid = param_id(key)
    return pid if pid in names else len(names) + 1  # type: ignore[operator]


# ---------------------------------------------------------------- the flattened form


def flatten(optim: Mapping) -> dict:
    """Return an FQN-keyed optimizer in torch's flattened form, as ``_flatten_optim_state_dict`` writes it.

    State first (``state.<fqn>.<name>``, nested state dotted further), then each group's
    hyper-parameters once per parameter (``param_groups.<fqn>.<name>``). A parameter
    whose state is empty has no key: unflattening gives it no state, which is the same.
    A group without parameters has nowhere to keep its hyper-parameters, so it is refused.
    """
    out: dict = {}
    for fqn, entry in optim["state"].items():
        if not isinstance(entry, Mapping):
            raise RekeyError(f"the state of '{fqn}' is a {type(entry).__name__}, not a dict")
        _flatten_state(entry, f"{FLAT_STATE}{fqn}", out)
    for g, group in enumerate(optim["param_groups"]):
        params = list(group.get("params", []))
        if not params:
            raise RekeyError(
                f"param group {g} has no parameters, and the flattened form keeps "
                "hyper-parameters only beside a parameter"
            )
        for fqn in params:
            for name, value in group.items():
                if name != "params":
                    out[f"{FLAT_GROUPS}{fqn}.{name}"] = value
    return out


def _flatten_state(entry: Mapping, prefix: str, out: dict) -> None:
    for name, value in entry.items():
        key = f"{prefix}.{name}"
        if isinstance(value, Mapping) and value:
            _flatten_state(value, key, out)
        else:
            out[key] = value


def unflatten(flat: Mapping, model: ModelParams | None = None) -> dict:
    """Return a flattened optimizer in the nested FQN form ``get_optimizer_state_dict`` gives.

    torch's ``_unflatten_optim_state_dict`` takes group membership from the live
    optimizer and each group's hyper-parameters from its first parameter. Offline, the
    groups are ``--model``'s param groups when it gives them, else the parameters
    grouped by equal hyper-parameters (in order of first appearance); either way every
    parameter of a group must have the same ones. Nested state (``state.<fqn>.a.b``)
    is rebuilt by splitting the name at dots, as torch does.
    """
    parsed = parse_flat(flat)
    state: dict[str, dict] = {}
    for key, p in parsed.items():
        if p.section != "state":
            continue
        if p.fqn is None:
            raise RekeyError(f"optimizer state '{key}' names no parameter in param_groups")
        node = state.setdefault(p.fqn, {})
        *parents, last = p.name.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = flat[key]
    hyper = flat_hyperparameters(flat, parsed)
    groups = _flat_groups(hyper, model)
    param_groups = []
    for fqns in groups:
        first = hyper[fqns[0]]
        for fqn in fqns[1:]:
            if hyperparameter_key(hyper[fqn]) != hyperparameter_key(first):
                raise RekeyError(
                    f"'{fqns[0]}' and '{fqn}' are in one param group but their "
                    "hyper-parameters differ"
                )
        param_groups.append({**first, "params": list(fqns)})
    return {"state": state, "param_groups": param_groups}


def _flat_groups(
    hyper: Mapping[str, Mapping[str, object]], model: ModelParams | None
) -> list[list[str]]:
    """Return the FQNs of each param group of a flattened optimizer (see ``unflatten``)."""
    if model is not None and model.groups is not None:
        groups = [[f for f in g if f in hyper] for g in model.groups]
        listed = {f for g in groups for f in g}
        unknown = [f for f in hyper if f not in listed]
        if unknown:
            raise GroupError(
                f"'{unknown[0]}' is in the optimizer state but in no param group of the model"
            )
        empty = [i for i, g in enumerate(groups) if not g]
        if empty:
            raise GroupError(
                f"param group {empty[0]} of the model has no parameter in the flattened "
                "optimizer, which therefore holds none of its hyper-parameters"
            )
        return groups
    for fqn, values in hyper.items():
        for name, value in values.items():
            if is_tensor_leaf(value):
                raise GroupError(
                    f"hyper-parameter '{name}' of '{fqn}' is a tensor, so parameters cannot "
                    "be grouped by equal hyper-parameters without reading it"
                )
    return groups_by_value(hyper)


# ---------------------------------------------------------------- which FQN each ID is


def state_shapes(optim: Mapping) -> list[list[tuple[int, ...] | None]]:
    """Return, per group and position, the parameter shape its state implies (None: unknown).

    Per-parameter state tensors (``exp_avg``, ``momentum_buffer``, ``sum``) have the
    parameter's shape; 0-dim ones (``step``) say nothing, and neither does a parameter
    without state, nor state whose tensors disagree (factored second moments).
    """
    state = {param_id(k): v for k, v in optim["state"].items()}
    out = []
    for params in _groups(optim):
        row = []
        for key in params:
            entry = state.get(param_id(key), {})
            shapes = {
                tuple(v.shape)
                for v in (entry.values() if isinstance(entry, Mapping) else ())
                if is_tensor_leaf(v) and len(v.shape) > 0
            }
            row.append(shapes.pop() if len(shapes) == 1 else None)
        out.append(row)
    return out


@dataclass(frozen=True)
class Candidate:
    """A tensor that may be a parameter: its FQN, shape and whether it can have a gradient."""

    fqn: str
    shape: tuple[int, ...]
    floating: bool = True


def infer_groups(optim: Mapping, candidates: Sequence[Candidate]) -> list[list[str]]:
    """Return the FQN of every param ID: the one way to pick, in order, a candidate per ID.

    Each group keeps the candidates' order; a candidate is used at most once and may be
    left out (a buffer, the second name of a tied weight, a frozen parameter); shapes
    must agree with the state. Zero or several ways raise ``OrderError``.
    """
    need = state_shapes(optim)
    sizes = tuple(len(n) for n in need)
    # Partial assignments by how many IDs of each group are placed: (ways capped at 2,
    # the placements as a linked list (candidate, group, rest) to rebuild the one way).
    layer: dict[tuple[int, ...], tuple[int, object]] = {(0,) * len(sizes): (1, None)}
    for i, cand in enumerate(candidates):
        layer = _place(layer, i, cand, need, room=len(candidates) - i - 1)
        if len(layer) > MAX_INFERENCE_STATES:
            raise OrderError("too many ways to match the model's tensors to the optimizer's IDs")
    ways, link = layer.get(sizes, (0, None))
    if ways == 0:
        raise OrderError(
            f"no order of the model's {len(candidates)} tensors fits the optimizer's "
            f"param groups of {list(sizes)} parameters"
        )
    if ways > 1:
        raise OrderError("more than one assignment of the model's tensors fits the optimizer's IDs")
    out: list[list[str]] = [[] for _ in sizes]
    while link is not None:
        i, g, link = link  # type: ignore[misc]
        out[g].append(candidates[i].fqn)
    return [list(reversed(fqns)) for fqns in out]


def _place(
    layer: dict[tuple[int, ...], tuple[int, object]],
    i: int,
    cand: Candidate,
    need: list[list[tuple[int, ...] | None]],
    room: int,
) -> dict[tuple[int, ...], tuple[int, object]]:
    """Return the partial assignments after candidate ``i`` is left out or placed."""
    sizes = [len(n) for n in need]
    total = sum(sizes)
    nxt: dict[tuple[int, ...], tuple[int, object]] = {}
    for counts, (ways, link) in layer.items():
        moves = [(counts, link)]
        for g, c in enumerate(counts):
            if c < sizes[g] and cand.floating and need[g][c] in (None, cand.shape):
                moves.append((counts[:g] + (c + 1,) + counts[g + 1 :], (i, g, link)))
        for new, new_link in moves:
            if total - sum(new) > room:
                continue  # too few candidates remain for the IDs still unplaced
            before, first = nxt.get(new, (0, new_link))
            nxt[new] = (min(before + ways, 2), first)
    return nxt


def groups_from_model(optim: Mapping, model: ModelParams) -> list[list[str]]:
    """Return each ID's FQN from ``--model``: its param groups, or inferred from its parameters."""
    if model.groups is None:
        cands = [Candidate(f, s) for f, s in zip(model.fqns, model.shapes)]
        return infer_groups(optim, cands)
    shape_of = dict(zip(model.fqns, model.shapes))
    for row, fqns in zip(state_shapes(optim), model.groups):
        for shape, fqn in zip(row, fqns):
            if shape is not None and shape != shape_of[fqn]:
                raise OrderError(
                    f"'{fqn}' has shape {list(shape_of[fqn])} in the model "
                    f"but its optimizer state has {list(shape)}"
                )
    return [list(g) for g in model.groups]


def model_candidates(tree: Mapping, optim_path: Path) -> list[Candidate]:
    """Return the model state beside the optimizer at ``optim_path``, as candidates in order.

    The model state is the one mapping beside the optimizer that holds tensors (``model``
    in ``{"model", "optim"}``), or the tensors beside the optimizer themselves.
    """
    if not optim_path:
        raise OrderError("the checkpoint holds no model state to take the parameter order from")
    parent = subtree(tree, optim_path[:-1])
    found = []
    if any(is_tensor_leaf(v) for v in parent.values()):
        found.append({k: v for k, v in parent.items() if is_tensor_leaf(v)})
    found += [
        v
        for v in parent.values()
        if isinstance(v, Mapping) and not is_optimizer(v) and _holds_tensors(v)
    ]
    if len(found) != 1:
        where = dotted(optim_path[:-1]) or "the top level"
        raise OrderError(
            f"{'no' if not found else len(found)} model states beside the optimizer at {where}"
        )
    return [
        Candidate(dotted(p), tuple(leaf.shape), leaf.dtype.is_floating_point)
        for p, leaf in _tensor_leaves(found[0])
    ]


def _holds_tensors(node: Mapping) -> bool:
    return any(True for _ in _tensor_leaves(node))


def _tensor_leaves(node: Mapping, prefix: Path = ()):
    for k, v in node.items():
        if is_tensor_leaf(v):
            yield prefix + (k,), v
        elif isinstance(v, Mapping) and not is_optimizer(v):
            yield from _tensor_leaves(v, prefix + (k,))


# ---------------------------------------------------------------- renames and drops


def map_fqns(tree: object, fn: FqnMap, prefix: Path = (), model_at: Path = ()) -> object:
    """Return ``tree`` with ``fn`` applied to FQNs: tensor keys, FQN state keys, ``params`` entries.

    A None from ``fn`` drops the tensor, the parameter's state and its ``params`` entry.
    Plain values keep their names. Raises ``KeyError`` naming both originals on a collision.
    ``fn`` is told where each tensor sits: a model tensor's own container, an optimizer's
    parameters the model state beside it (``model_at``, found by ``model_beside``).
    """
    if not isinstance(tree, Mapping):
        return tree

    def at_model(fqn: str) -> str | None:
        return fn(fqn, model_at)

    if is_flat_optimizer(tree):
        return rename_flat(tree, at_model, prefix)
    if is_optimizer(tree) and key_type(tree) == "fqn":
        state = _rename_mapping(tree["state"], at_model, prefix + ("state",), lambda _k, _v: True)
        params = [[n for n in map(at_model, p) if n is not None] for p in _groups(tree)]
        return _with(tree, state, params, params)
    if is_optimizer(tree):
        return tree
    out = _rename_mapping(tree, lambda k: fn(k, prefix), prefix, lambda _k, v: is_tensor_leaf(v))
    beside = model_beside(tree, prefix)
    return {k: map_fqns(v, fn, prefix + (k,), beside) for k, v in out.items()}


def fqn_names(tree: object) -> list[tuple[str, Path]]:
    """Return ``(fqn, where)`` for every name ``map_fqns`` would hand its function, in tree order.

    An ID-keyed optimizer names no FQN until rekeyed: its parameters are the model
    tensors beside it, listed already.
    """
    seen: list[tuple[str, Path]] = []

    def record(fqn: str, where: Path) -> str:
        seen.append((fqn, where))
        return fqn

    map_fqns(tree, record)
    return seen


def model_beside(node: Mapping, prefix: Path) -> Path:
    """Return the path of the model state an optimizer in ``node`` (at ``prefix``) belongs to.

    As ``model_candidates`` finds it: ``node`` itself when it holds tensors beside the
    optimizer, else the one mapping beside it that holds tensors, else ``model``'s place.
    """
    if any(is_tensor_leaf(v) for v in node.values()):
        return prefix
    found = [
        k
        for k, v in node.items()
        if isinstance(v, Mapping) and not is_optimizer(v) and _holds_tensors(v)
    ]
    if len(found) == 1:
        return prefix + (found[0],)
    return prefix + (("model",) if isinstance(node.get("model"), Mapping) else ())


def _rename_mapping(
    node: Mapping, fn: FqnMap, prefix: Path, is_fqn: Callable[[object, object], bool]
) -> dict:
    out: dict = {}
    origin: dict = {}
    for k, v in node.items():
        nk = fn(k) if isinstance(k, str) and is_fqn(k, v) else k
        if nk is None:
            continue
        if nk in out:
            raise KeyError((dotted(prefix + (origin[nk],)), dotted(prefix + (k,)), nk))
        origin[nk] = k
        out[nk] = v
    return out


# ---------------------------------------------------------------- the whole tree


def rekey(
    tree: Mapping,
    optim_keys: str,
    fqn_map: FqnMap | None = None,
    model: ModelParams | None = None,
) -> dict:
    """Return ``tree`` with FQNs mapped and every optimizer keyed as ``optim_keys`` asks.

    ID-keyed optimizers go through FQNs when renaming, dropping or asked for ``fqn`` or
    ``flat``; ``keep`` returns them to IDs afterwards, renumbered. The parameter order
    comes from ``model`` or, without it, from the model state beside each optimizer.
    Flattened optimizers are renamed key by key, and nested (``unflatten``) for ``fqn``
    and ``id``; ``flat`` flattens every other one.
    """
    paths = find_optimizers(tree)
    was_id = {p: key_type(subtree(tree, p)) == "id" for p in paths}
    out: dict = dict(tree)
    if fqn_map is not None or optim_keys in ("fqn", "flat"):
        for path in (p for p in paths if was_id[p]):
            optim = subtree(out, path)
            fqns = (
                groups_from_model(optim, model)
                if model is not None
                else stored_names(optim) or infer_groups(optim, model_candidates(out, path))
            )
            out = _replace(out, path, ids_to_fqns(optim, fqns))
    if fqn_map is not None:
        out = map_fqns(out, fqn_map)  # type: ignore[assignment]
    for path in paths:
        optim = subtree(out, path)
        if not is_optimizer(optim):
            continue  # a flattened optimizer whose every parameter --drop removed
        if optim_keys in ("fqn", "id") and is_flat_optimizer(optim):
            optim = unflatten(optim, model)
            out = _replace(out, path, optim)
        kind = key_type(optim)
        want = "id" if optim_keys == "id" or (optim_keys == "keep" and was_id[path]) else None
        if want == "id" and kind == "fqn":
            out = _replace(out, path, fqns_to_ids(optim, model))
        elif optim_keys == "id" and kind == "id":
            out = _replace(out, path, normalize_ids(optim))
        elif optim_keys == "flat" and kind in ("fqn", "empty"):
            out = _replace(out, path, flatten(optim))
    return out


def _replace(tree: Mapping, path: Path, node: object) -> dict:
    """Return a copy of ``tree`` with the node at ``path`` replaced (ancestors copied, not mutated)."""
    if not path:
        return node  # type: ignore[return-value]
    head, rest = path[0], path[1:]
    return {**tree, head: _replace(tree[head], rest, node)}
