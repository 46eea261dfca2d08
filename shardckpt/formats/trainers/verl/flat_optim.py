"""veRL's FSDP1 optimizer files: each rank's ``optimizer.state_dict()`` of flat-parameter slices.

Under FSDP1 without ``use_orig_params`` the optimizer holds one parameter per FSDP unit,
its ``FlatParameter``, and rank r holds elements ``[r * s, (r + 1) * s)`` of each (``s``
the unit's padded shard size). veRL saves each rank's ``optimizer.state_dict()`` as it is:
param IDs in the flat parameters' order, per-parameter state of ``s`` elements, a 0-dim
``step``. Which original parameters a flat parameter holds, and where, only FSDP1's
wrapping of the model says: with ``--model``/``--wrap`` (``shardckpt.formats.fsdp1.flat_layout``) the
state is read as FSDP1's full ``optim_state_dict`` keys it, by FQN, each parameter's
state its own elements of the flat state; without them the index shows the flat state
as stored, and reading it is refused with the reason.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import prod
from pathlib import Path

import torch

from shardckpt.core.errors import BadInputError, UsageError
from shardckpt.formats.base import Index, Reader, Rows
from shardckpt.formats.fsdp1.flat_layout import FlatLayout, FlatModel, flat_layouts
from shardckpt.formats.ranks.rank_set import check_one_save
from shardckpt.formats.torch_save.in_place import load_in_place, values
from shardckpt.state.tree import TensorMeta, is_nested_optimizer, walk

NEEDS_MODEL = (
    "holds FSDP1's optimizer state as each rank's slices of flat parameters, and only "
    "the model's FSDP1 wrapping says which parameter each element belongs to"
)
NEEDS_MODEL_HINT = (
    "pass --model pkg.module:factory and --wrap the classes veRL wrapped (its decoder "
    "layer class), or --only model"
)


@dataclass(frozen=True)
class _Slice:
    """Elements ``[start, start + numel)`` of state ``name`` of flat parameter ``pid``, as ``shape``."""

    pid: int
    name: str
    start: int
    shape: tuple[int, ...]


class FlatOptimReader(Reader):
    """Reads the per-rank optimizer files of a veRL FSDP1 directory (``files``: rank -> file)."""

    format = "fsdp1-flat-optim"

    def __init__(
        self,
        src,
        trust_pickle: bool,
        files: Mapping[int, Path],
        flat_model: FlatModel | None = None,
    ):
        super().__init__(src, trust_pickle)
        self.files = [files[r] for r in sorted(files)]
        self.world_size = len(self.files)
        self.flat_model = flat_model
        # A URL SRC's files on the meta device: the slices a rank copies are read by ranges.
        self.states = [load_in_place(p, trust_pickle) for p in self.files]
        self.shard = self._check()
        self._slices: dict[str, _Slice] = {}
        self._tree = self._by_fqn() if flat_model is not None else self._as_stored()

    def members(self) -> frozenset[str]:
        return frozenset(p.name for p in self.files)

    def _check(self) -> dict[int, int]:
        """Return each flat parameter's shard size; refuse files that are not one save's slices."""
        first = self.states[0]
        if not is_nested_optimizer(first):
            raise BadInputError(
                "holds no optimizer state dict (no 'state' and 'param_groups')",
                path=self.files[0],
                hint="pass the directory veRL's FSDPCheckpointManager saved",
            )
        # Each rank holds its own slice of every state tensor; everything else is shared.
        check_one_save(self.files, self.states, own=lambda p: p[:1] == ("state",) and len(p) == 3)
        shard: dict[int, int] = {}
        for file, state in zip(self.files, self.states):
            for path, leaf in walk(state["state"]):
                if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
                    continue
                pid = path[0]
                if leaf.dim() != 1 or shard.setdefault(pid, leaf.numel()) != leaf.numel():
                    raise BadInputError(
                        f"'state.{pid}.{path[-1]}' is {list(leaf.shape)}, not the flat slice of "
                        f"{shard[pid]} elements rank 0 holds",
                        path=file,
                        hint="this is not FSDP1 flat-parameter optimizer state "
                        "(use_orig_params=False); every rank's file must come from one save",
                    )
        return shard

    def _as_stored(self) -> dict:
        """Return the optimizer with each flat state tensor whole over the ranks (for ``inspect``)."""
        n = self.world_size

        def state(pid, name, leaf):
            if leaf.dim() == 0:
                return self._meta(pid, name, 0, ())
            meta = self._meta(pid, name, 0, (leaf.numel() * n,))
            return TensorMeta(meta.key, meta.shape, meta.dtype, f"flat over {n} (padded)")

        return self._tree_of(
            {pid: {k: state(pid, k, v) for k, v in s.items()} for pid, s in self._stored().items()},
            [list(g["params"]) for g in self.states[0]["param_groups"]],
        )

    def _by_fqn(self) -> dict:
        """Return the optimizer keyed by FQN, each parameter's state its elements of its unit's."""
        assert self.flat_model is not None
        layouts = flat_layouts(self.flat_model, self.world_size, 0, False)
        stored = self._stored()
        if len(layouts) != len(stored):
            raise BadInputError(
                f"holds state for {len(stored)} flat parameters, but --model/--wrap wrap the model "
                f"in {len(layouts)} FSDP units",
                path=self.files[0],
                hint="pass the --wrap classes veRL wrapped (each decoder layer is one unit)",
            )
        names: dict[int, list[str]] = {}
        state: dict[str, dict] = {}
        for (pid, entry), lay in zip(stored.items(), layouts):
            self._check_unit(pid, lay)
            names[pid] = [lay.prefix + f for f in lay.fqns]
            for fqn, start, shape in zip(names[pid], lay.starts().values(), lay.shapes):
                state[fqn] = {
                    k: self._meta(pid, k, start if v.dim() else 0, tuple(shape) if v.dim() else ())
                    for k, v in entry.items()
                }
        groups = [
            [f for pid in g["params"] for f in names[pid]] for g in self.states[0]["param_groups"]
        ]
        return self._tree_of(state, groups)

    def _check_unit(self, pid: int, lay: FlatLayout) -> None:
        if self.shard.get(pid, lay.shard_numel) != lay.shard_numel:
            raise BadInputError(
                f"flat parameter {pid} has slices of {self.shard[pid]} elements, but --model/--wrap "
                f"make its unit ('{lay.prefix or '<root>'}') {lay.shard_numel} per rank",
                path=self.files[0],
                hint="pass the --model and --wrap classes veRL trained with",
            )

    def _stored(self) -> dict[int, dict]:
        """Return rank 0's state by param ID, in the IDs' order (the flat parameters' order)."""
        state = self.states[0]["state"]
        return {pid: state[pid] for pid in sorted(state)}

    def _tree_of(self, state: dict, params: Sequence[list]) -> dict:
        groups = [{**g, "params": list(p)} for g, p in zip(self.states[0]["param_groups"], params)]
        return {"state": state, "param_groups": groups}

    def _meta(self, pid: int, name: str, start: int, shape: tuple[int, ...]) -> TensorMeta:
        key = str(len(self._slices))
        self._slices[key] = _Slice(pid, name, start, shape)
        dtype = self.states[0]["state"][pid][name].dtype
        return TensorMeta(key, shape, dtype)

    def index(self) -> Index:
        return Index(self.format, str(self.src), self.world_size, self._tree)

    def check_selected(self, tree: dict) -> None:
        if self.flat_model is None and any(isinstance(m, TensorMeta) for _, m in walk(tree)):
            raise UsageError(NEEDS_MODEL, path=self.src, hint=NEEDS_MODEL_HINT)

    def read(
        self, metas: Sequence[TensorMeta], rows: Sequence[Rows], runtime
    ) -> list[torch.Tensor]:
        return [self._read_one(m, r) for m, r in zip(metas, rows)]

    def _read_one(self, meta: TensorMeta, rows: Rows) -> torch.Tensor:
        s = self._slices[meta.key]
        if not s.shape:
            return values(self.states[0]["state"][s.pid][s.name])
        row = prod(s.shape[1:])
        a, b = rows if rows is not None else (0, s.shape[0])
        lo, hi = s.start + a * row, s.start + b * row
        size = self.shard[s.pid]
        if hi <= lo:
            return torch.empty((0,) + s.shape[1:], dtype=meta.dtype)
        # The flat state is the ranks' slices one after another: take the part of each.
        pieces = [
            values(
                self.states[rank]["state"][s.pid][s.name][
                    max(lo - rank * size, 0) : min(hi - rank * size, size)
                ]
            )
            for rank in range(lo // size, (hi - 1) // size + 1)
        ]
        flat = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        return flat.view((b - a,) + s.shape[1:])
