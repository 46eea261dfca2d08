"""Damaged and hostile copies of the DeepSpeed goldens, written without DeepSpeed.

DeepSpeed's files name three of its classes; ``deepspeed_classes`` puts look-alikes
under those names (unless DeepSpeed itself is installed), so that plain pickle can load
a golden file, a test can change one field, and ``torch.save`` writes it back naming the
same classes, as DeepSpeed would have.
"""

from __future__ import annotations

import enum
import importlib.util
import shutil
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

_MODULES = (
    "deepspeed",
    "deepspeed.runtime",
    "deepspeed.runtime.fp16",
    "deepspeed.runtime.fp16.loss_scaler",
    "deepspeed.runtime.zero",
    "deepspeed.runtime.zero.config",
    "deepspeed.utils",
    "deepspeed.utils.tensor_fragment",
)


def _look_alikes() -> dict[str, types.ModuleType]:
    modules = {name: types.ModuleType(name) for name in _MODULES}

    class LossScaler:
        pass

    class DynamicLossScaler(LossScaler):
        pass

    class ZeroStageEnum(int, enum.Enum):
        disabled = 0
        optimizer_states = 1
        gradients = 2
        weights = 3

    @dataclass
    class fragment_address:  # noqa: N801  (DeepSpeed's name)
        numel: int
        start: int

    for cls, module in (
        (LossScaler, "deepspeed.runtime.fp16.loss_scaler"),
        (DynamicLossScaler, "deepspeed.runtime.fp16.loss_scaler"),
        (ZeroStageEnum, "deepspeed.runtime.zero.config"),
        (fragment_address, "deepspeed.utils.tensor_fragment"),
    ):
        cls.__module__ = module
        cls.__qualname__ = cls.__name__
        setattr(modules[module], cls.__name__, cls)
    return modules


@contextmanager
def deepspeed_classes() -> Iterator[None]:
    """Make DeepSpeed's pickled class names loadable and savable by plain pickle, for a while."""
    if importlib.util.find_spec("deepspeed") is not None:
        yield
        return
    saved = {name: sys.modules.get(name) for name in _MODULES}
    sys.modules.update(_look_alikes())
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def edit_file(path: Path, edit: Callable[[dict], object]) -> None:
    """Rewrite a DeepSpeed file with ``edit`` applied to what it holds (its return value, if any, saved instead)."""
    with deepspeed_classes():
        obj = torch.load(path, weights_only=False)
        new = edit(obj)
        torch.save(obj if new is None else new, path)


def stage_enum(value: int) -> object:
    """Return ``ZeroStageEnum(value)`` as pickled into an optimizer file (inside ``deepspeed_classes``)."""
    return sys.modules["deepspeed.runtime.zero.config"].ZeroStageEnum(value)


def copy_run(src: Path, root: Path) -> Path:
    """Return a copy of a golden run directory under ``root``."""
    dst = root / src.name
    shutil.copytree(src, dst)
    return dst


def _loaded(path: Path) -> object:
    with deepspeed_classes():
        return torch.load(path, weights_only=False, map_location="cpu")


def _differing(a: object, b: object, where: str) -> list[str]:
    """Return where two loaded DeepSpeed files differ: tensors bit for bit, objects by their fields."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
        return [] if same else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if list(a) != list(b):
            return [f"{where}: keys {list(a)} != {list(b)}"]
        return [d for k in a for d in _differing(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return [f"{where}: {a!r} != {b!r}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differing(x, y, f"{where}[{i}]")]
    if isinstance(a, enum.Enum) or isinstance(b, enum.Enum):
        # By class name and value: each load without DeepSpeed makes its own look-alike class.
        same = type(a).__name__ == type(b).__name__ and (a.name, a.value) == (b.name, b.value)
        return [] if same else [f"{where}: {a!r} != {b!r}"]
    if hasattr(a, "__dict__") and not isinstance(a, type):
        if type(a).__name__ != type(b).__name__:
            return [f"{where}: {type(a).__name__} != {type(b).__name__}"]
        return _differing(vars(a), vars(b), where)
    return [] if a == b and type(a) is type(b) else [f"{where}: {a!r} != {b!r}"]


def differences(ours: Path, theirs: Path) -> list[str]:
    """Return how two DeepSpeed run directories differ: their files, and every field of every ``.pt``."""
    names = sorted(p.relative_to(ours) for p in ours.rglob("*") if p.is_file())
    other = sorted(p.relative_to(theirs) for p in theirs.rglob("*") if p.is_file())
    if names != other:
        return [f"files {names} != {other}"]
    out = []
    for name in names:
        if name.suffix == ".pt":
            out += _differing(_loaded(ours / name), _loaded(theirs / name), str(name))
        elif (ours / name).read_text().strip() != (theirs / name).read_text().strip():
            out.append(str(name))
    return out
