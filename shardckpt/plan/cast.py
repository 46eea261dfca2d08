"""``--dtype``: which tensors change dtype (pure), and a reader that casts what it reads.

Model floating-point tensors are cast; integers and booleans never are. Optimizer state
is cast only with ``--cast-optim``, and its ``step`` counters never: torch keeps
``step`` in float32 (or float64), and in bf16 a step above 256 already loses its
integer value, which would change the bias correction of a resumed Adam.

The cast happens on every rank right after reading its rows. A cast is elementwise,
so casting rows before the all-gather gives the same bytes as casting the whole
tensor after it; doing it in the reader keeps one path for full outputs, sharded
outputs and ``--verify`` (which then compares DST with the cast source).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from shardckpt.core.errors import UsageError
from shardckpt.core.lazy_torch import torch
from shardckpt.formats.base import Index, Reader, Rows
from shardckpt.state.tree import (
    FLAT_STATE,
    TensorMeta,
    find_optimizers,
    map_leaves,
    model_leaves,
    walk,
)

DTYPES = {"keep": None, "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
"""Our names for the dtypes ``--dtype`` casts to, and torch's."""
# torch's own names are accepted too: bfloat16, float16/half, float32/float, also as torch.X.
_TORCH_NAMES = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float32": "fp32",
    "float": "fp32",
}
DTYPE_NAMES = (*DTYPES, *_TORCH_NAMES)


def dtype_name(name: str) -> str:
    """Return our name (``keep``, ``bf16``, ``fp16``, ``fp32``) for ``name``, or torch's name of it."""
    bare = name.strip().lower().removeprefix("torch.")
    short = _TORCH_NAMES.get(bare, bare)
    if short not in DTYPES:
        raise UsageError(
            f"--dtype {name!r} is not a dtype it casts to",
            hint="use keep, bf16, fp16 or fp32 (or torch's bfloat16, float16, float32)",
        )
    return short


def target_dtype(name: str) -> torch.dtype | None:
    """Return the dtype ``--dtype name`` casts to (None for ``keep``)."""
    torch_name = DTYPES[dtype_name(name)]
    return None if torch_name is None else getattr(torch, torch_name)


def cast_tree(
    tree: Mapping, dtype: torch.dtype | None, cast_optim: bool
) -> tuple[dict, dict[str, torch.dtype]]:
    """Return ``tree`` with cast tensors' metas in ``dtype``, and each cast key's source dtype."""
    if dtype is None:
        return dict(tree), {}
    chosen = {p for p, leaf in model_leaves(tree) if isinstance(leaf, TensorMeta)}
    if cast_optim:
        optimizers = find_optimizers(tree)
        chosen.update(
            p
            for p, leaf in walk(tree)
            if isinstance(leaf, TensorMeta) and _optimizer_state(optimizers, p) and not _is_step(p)
        )
    read_as: dict[str, torch.dtype] = {}

    def cast(path, leaf):
        if path not in chosen or not leaf.dtype.is_floating_point or leaf.dtype == dtype:
            return leaf
        read_as[leaf.key] = leaf.dtype
        return dataclasses.replace(leaf, dtype=dtype)

    return map_leaves(tree, cast), read_as  # type: ignore[return-value]


def _optimizer_state(optimizers: list[tuple], path: tuple) -> bool:
    """Return whether ``path`` lies in the state of one of ``optimizers`` (``state``, or a flattened ``state.`` key)."""
    for opt in optimizers:
        if path[: len(opt)] != opt or len(path) == len(opt):
            continue
        here = path[len(opt)]
        if here == "state" or (
            isinstance(here, str) and here.startswith(FLAT_STATE) and len(path) == len(opt) + 1
        ):
            return True
    return False


def _is_step(path: tuple) -> bool:
    """Return whether ``path`` is a ``step`` counter (see the module docstring), flattened or not."""
    last = path[-1]
    return last == "step" or (
        isinstance(last, str) and last.startswith(FLAT_STATE) and last.endswith(".step")
    )


class CastReader(Reader):
    """Reads through another reader in each tensor's source dtype, then casts to the meta's."""

    def __init__(self, inner: Reader, read_as: Mapping[str, torch.dtype]):
        super().__init__(inner.src, inner.trust_pickle)
        self.format = inner.format
        self.inner = inner
        self.read_as = dict(read_as)

    def index(self) -> Index:
        return self.inner.index()

    def files_for(self, meta: TensorMeta, rows: Rows) -> list[tuple[Rows, frozenset[str]]]:
        return self.inner.files_for(meta, rows)

    def read(
        self, metas: Sequence[TensorMeta], rows: Sequence[Rows], runtime
    ) -> list[torch.Tensor]:
        sources = [
            dataclasses.replace(m, dtype=self.read_as[m.key]) if m.key in self.read_as else m
            for m in metas
        ]
        tensors = self.inner.read(sources, rows, runtime)
        return [t if t.dtype == m.dtype else t.to(m.dtype) for m, t in zip(metas, tensors)]
