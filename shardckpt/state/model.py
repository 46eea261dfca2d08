"""``--model pkg.module:factory``: the user's model, built on the meta device, as parameter names.

The factory is a zero-argument callable returning an ``nn.Module`` or a pair
``(module, param_groups)``, where ``param_groups`` is what training passed to the
optimizer. It runs under ``torch.device("meta")`` so that no parameter takes memory.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping

from shardckpt.core.errors import UsageError
from shardckpt.core.lazy_torch import torch
from shardckpt.state.optim import ModelParams
from shardckpt.state.tree import clean_fqn

_HINT = "pass --model pkg.module:factory, a zero-argument callable returning a module or (module, param_groups)"


def load_factory(spec: str) -> Callable[[], object]:
    """Return the callable ``spec`` (``pkg.module:factory``) names."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"--model {spec!r} is not pkg.module:factory", hint=_HINT)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's to fix
        raise UsageError(
            f"--model {spec!r}: cannot import {module_name!r} ({type(exc).__name__}: {exc})",
            hint="check the module name and that its package is on PYTHONPATH",
        ) from None
    target: object = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise UsageError(f"--model {spec!r}: {module_name!r} has no {attr!r}", hint=_HINT)
        target = getattr(target, part)
    if not callable(target):
        raise UsageError(f"--model {spec!r}: {attr!r} is not callable", hint=_HINT)
    return target  # type: ignore[return-value]


def model_params(spec: str, clean_fqns: bool = True) -> ModelParams:
    """Return the parameters of the model ``spec`` builds on the meta device."""
    module, groups = build_model(spec)
    return params_of(module, groups, clean_fqns, where=f"--model {spec!r}")


def build_model(spec: str) -> tuple[torch.nn.Module, object]:
    """Return the module ``spec`` builds on the meta device, and its param groups (None if not given)."""
    factory = load_factory(spec)
    try:
        with torch.device("meta"):
            built = factory()
    except Exception as exc:  # noqa: BLE001 - the user's code: report it in one line
        raise UsageError(
            f"--model {spec!r} failed on the meta device ({type(exc).__name__}: {exc})", hint=_HINT
        ) from None
    module, groups = built if isinstance(built, tuple) and len(built) == 2 else (built, None)
    if not isinstance(module, torch.nn.Module):
        raise UsageError(
            f"--model {spec!r} returned {type(module).__name__}, not an nn.Module", hint=_HINT
        )
    return module, groups


def params_of(
    module: torch.nn.Module,
    groups: object = None,
    clean_fqns: bool = True,
    where: str = "the model",
) -> ModelParams:
    """Return ``module``'s parameters in ``named_parameters()`` order (tied ones once), groups, buffers."""
    name_fn = clean_fqn if clean_fqns else str
    named = list(module.named_parameters())  # torch's order; a tied parameter under its first name
    fqn_of = {id(p): name_fn(n) for n, p in named}
    fqns = tuple(fqn_of[id(p)] for _, p in named)
    shapes = tuple(tuple(p.shape) for _, p in named)
    aliases, buffers = _state_dict_names(module, name_fn, set(fqns), where)
    if groups is None:
        return ModelParams(fqns, shapes, aliases=aliases, buffers=buffers)
    group_list = list(groups) if not isinstance(groups, torch.Tensor) else [groups]
    if group_list and not isinstance(group_list[0], Mapping):
        group_list = [{"params": group_list}]  # a plain list of parameters: one group
    out = []
    for g in group_list:
        params = g["params"] if isinstance(g, Mapping) else g
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        missing = [i for i, p in enumerate(params) if id(p) not in fqn_of]
        if missing:
            raise UsageError(
                f"{where}: a param group holds a tensor that is not a parameter of the module",
                hint=_HINT,
            )
        out.append(tuple(fqn_of[id(p)] for p in params))
    return ModelParams(fqns, shapes, tuple(out), aliases, buffers)


def _state_dict_names(
    module: torch.nn.Module, name_fn: Callable[[str], str], fqns: set[str], where: str
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Return the names ``module.state_dict()`` gives tied parameters' other FQNs, and its buffers.

    The state dict is asked, not the module tree, because it is what a checkpoint holds:
    persistent buffers only, every name of a tied parameter, and any renaming its hooks do.
    """
    try:
        state = module.state_dict(keep_vars=True)
    except Exception as exc:  # noqa: BLE001 - the user's code: report it in one line
        raise UsageError(
            f"{where}: state_dict() failed on the meta device ({type(exc).__name__}: {exc})",
            hint=_HINT,
        ) from None
    aliases, buffers = [], []
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue  # extra state a module keeps as a plain value
        if isinstance(value, torch.nn.Parameter):
            if name_fn(name) not in fqns:
                aliases.append(name_fn(name))
        else:
            buffers.append(name_fn(name))
    return tuple(aliases), tuple(buffers)
