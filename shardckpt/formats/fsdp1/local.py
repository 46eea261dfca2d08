"""``fsdp1-local``: one ``torch.save`` per rank of FSDP1's ``LOCAL_STATE_DICT`` (flat parameters).

Each FSDP unit's parameters are one ``FlatParameter``; rank r's file holds, under the
unit's prefix, ``_flat_param``: a 1-D ``ShardedTensor`` whose global size is the flat
parameter without its tail padding and whose local shard is the valid part of rank r's
padded shard, at offset ``r * shard_numel``. With ``use_orig_params=True`` FSDP1 also
saves each original parameter's piece of the shard as a flat tensor; those repeat the
flat parameter and are not read. Buffers are whole, as in training.

Which parameter sits where in a flat parameter comes from FSDP1 itself
(``shardckpt.formats.fsdp1.flat_layout``): ``--model`` and ``--wrap`` rebuild the wrapping at the
checkpoint's world size. Without them the tree shows the raw ``_flat_param`` tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod
from pathlib import Path

import torch

from shardckpt.codecs.pickle_scan import DamagedPickle, NotTorchFile, scan_torch_file
from shardckpt.core.errors import SRC_FORMAT, BadInputError
from shardckpt.core.files import source_file
from shardckpt.formats.base import Index, Reader, Rows
from shardckpt.formats.fsdp1.flat_layout import FLAT_PARAM, FlatLayout, FlatModel, flat_layouts
from shardckpt.formats.fsdp1.sharded import Fsdp1ShardedReader
from shardckpt.formats.ranks.rank_names import find_rank_files
from shardckpt.formats.ranks.rank_set import OwnTensors
from shardckpt.formats.ranks.sharded_tensor_load import SHARDED_TENSOR
from shardckpt.state.tree import Path as TreePath
from shardckpt.state.tree import TensorMeta, dotted, find_optimizers, map_leaves, walk


def is_flat_key(key: object) -> bool:
    """Return whether a state-dict key names an FSDP1 flat parameter."""
    return isinstance(key, str) and (key == FLAT_PARAM or key.endswith("." + FLAT_PARAM))


def detect_rank_format(src: Path) -> str | None:
    """Return the FSDP1 format of a directory of rank files, or None when it is not one.

    Rank 0's pickle is read as opcodes, never loaded (``pickle_scan``): detection runs
    before the user chose a format or a trust level, so it runs no code of the file's
    whatever the file holds. A flat parameter's key makes ``fsdp1-local``, a
    ShardedTensor without one ``fsdp1-sharded``.
    """
    try:
        parts = find_rank_files(src)
        if not parts:
            return None
        files = next(iter(parts.values()))
        found = scan_torch_file(source_file(files[min(files)]))
    except (BadInputError, DamagedPickle, NotTorchFile, OSError):
        return None
    if any(is_flat_key(text) for text in found.strings):
        return "fsdp1-local"
    if SHARDED_TENSOR in found.globals:
        return "fsdp1-sharded"
    return None


@dataclass(frozen=True)
class _Slice:
    """An original parameter inside a flat parameter: the flat tensor, its first element, its shape."""

    flat: TensorMeta
    start: int
    shape: tuple[int, ...]


def flat_label(position: int, count: int, padded: int) -> str:
    """Return the layout label of a parameter held in a flat parameter: ``flat param 3/4 (padded 12)``."""
    return f"flat param {position}/{count} (padded {padded})"


class _FlatFiles(Fsdp1ShardedReader):
    """fsdp1-local's files as stored: ``_flat_param`` ShardedTensors, buffers, parameter pieces."""

    format = "fsdp1-local"

    def __init__(self, src, trust_pickle: bool, flat_model: FlatModel | None):
        self.flat_model = flat_model
        self._layouts: dict[bool, list[FlatLayout]] = {}
        super().__init__(src, trust_pickle)

    def layouts(self, use_orig_params: bool) -> list[FlatLayout]:
        """Return the flat parameters FSDP1 makes of ``--model`` at the files' world size (rank 0)."""
        if use_orig_params not in self._layouts:
            assert self.flat_model is not None
            self._layouts[use_orig_params] = flat_layouts(
                self.flat_model, self.world_size, 0, use_orig_params
            )
        return self._layouts[use_orig_params]

    def own_tensors(self, tree: dict) -> OwnTensors:
        """Return the pieces of original parameters that FSDP1 saves with ``use_orig_params=True``.

        Each rank saves its own part of each parameter of a unit beside the unit's
        ``_flat_param`` (``_local_post_state_dict_hook``), so they differ from rank to
        rank. ``--model`` names them; without it, any plain tensor beside a
        ``_flat_param`` may be one, so none of those is compared. An optimizer subtree
        (a loop's own ``optim.state_dict()``) is each rank's state of its own flat shard
        too; ``check_selected`` refuses it when it is to be read.
        """
        units = {p[:-1] for p, _ in walk(tree) if p and is_flat_key(p[-1])}
        optimizers = find_optimizers(tree)
        names: set[str] | None = None
        if self.flat_model is not None:
            names = set()
            for lay in self.layouts(False):
                names |= {lay.prefix + f for f in lay.fqns}
                names |= {lay.prefix + alias for alias, _ in lay.shared}

        def own(path: TreePath) -> bool:
            if any(path[: len(o)] == o for o in optimizers):
                return True
            if path[:-1] not in units or is_flat_key(path[-1]):
                return False
            return names is None or path[-1] in names

        return own


class Fsdp1LocalReader(Reader):
    """Reads per-rank ``LOCAL_STATE_DICT`` files; with ``flat_model``, as the original parameters."""

    format = "fsdp1-local"

    def __init__(self, src, trust_pickle: bool = False, flat_model: FlatModel | None = None):
        super().__init__(src, trust_pickle)
        self.raw = _FlatFiles(src, trust_pickle, flat_model)
        self.flat_model = flat_model
        self._slices: dict[str, _Slice] = {}
        self._tree = self._expand(self.raw.index().tree) if flat_model else self._label_raw()

    def members(self) -> frozenset[str]:
        return self.raw.members()

    def _label_raw(self) -> dict:
        """Return the raw tree, each ``_flat_param`` labelled with its world size and tail padding."""
        tree = self.raw.index().tree
        n = self.raw.world_size

        def label(path, leaf):
            if not (path and is_flat_key(path[-1]) and isinstance(leaf, TensorMeta)):
                return leaf
            shard = leaf.chunks[1].offsets[0] if len(leaf.chunks) > 1 else leaf.shape[0]
            pad = shard * n - leaf.shape[0]
            return TensorMeta(
                leaf.key, leaf.shape, leaf.dtype, f"flat over {n} (padded {pad})", leaf.chunks
            )

        return map_leaves(tree, label)  # type: ignore[return-value]

    def _expand(self, tree: dict) -> dict:
        """Return ``tree`` with every ``_flat_param`` replaced by the parameters it holds."""
        n = self.raw.world_size
        flats = [(p, m) for p, m in walk(tree) if p and is_flat_key(p[-1])]
        if not flats:
            raise BadInputError(
                f"holds no '{FLAT_PARAM}' tensors",
                path=self.src,
                hint=f"this is not FSDP1 LOCAL_STATE_DICT; try {SRC_FORMAT} fsdp1-sharded",
            )
        layouts = {lay.prefix: lay for lay in self.raw.layouts(False)}
        use_orig = _saved_orig_params(tree, flats, layouts)
        if use_orig:
            layouts = {lay.prefix: lay for lay in self.raw.layouts(True)}
        replaced: dict[TreePath, dict[str, object]] = {}
        for path, meta in flats:
            prefix = path[-1][: -len(FLAT_PARAM)]
            layout = layouts.get(prefix)
            self._check(path, meta, layout, use_orig)
            replaced[path] = self._params(meta, layout, n)  # type: ignore[arg-type]
        return _replace_flat(tree, replaced)

    def _check(self, path, meta: TensorMeta, layout: FlatLayout | None, use_orig: bool) -> None:
        where = f"'{dotted(path)}'"
        how = f"--model/--wrap with use_orig_params={use_orig} at world size {self.raw.world_size}"
        if layout is None:
            raise BadInputError(
                f"{where} is a flat parameter that {how} does not make",
                path=self.src,
                hint="pass the --wrap classes training wrapped (each unit's prefix must match)",
            )
        shard = meta.chunks[1].offsets[0] if len(meta.chunks) > 1 else meta.shape[0]
        if meta.shape != (layout.unpadded_numel,) or shard != layout.shard_numel:
            raise BadInputError(
                f"{where} has {meta.shape[0]} elements in shards of {shard}, "
                f"but {how} makes {layout.unpadded_numel} in shards of {layout.shard_numel}",
                path=self.src,
                hint="pass the --model and --wrap classes the checkpoint was trained with",
            )

    def _params(self, flat: TensorMeta, layout: FlatLayout, n: int) -> dict[str, object]:
        """Return the parameters a flat parameter holds, as ``TensorMeta`` by their FQN."""
        out: dict[str, object] = {}
        starts = layout.starts()
        pad = layout.padding(n)
        label = {f: flat_label(i + 1, len(layout.fqns), pad) for i, f in enumerate(layout.fqns)}
        shape = dict(zip(layout.fqns, layout.shapes))
        for fqn in layout.fqns:
            out[layout.prefix + fqn] = self._meta(flat, starts[fqn], shape[fqn], label[fqn])
        for alias, primary in layout.shared:
            out[layout.prefix + alias] = self._meta(
                flat, starts[primary], shape[primary], label[primary]
            )
        return out

    def _meta(self, flat: TensorMeta, start: int, shape: tuple[int, ...], label: str) -> TensorMeta:
        key = f"p{len(self._slices)}"
        self._slices[key] = _Slice(flat, start, shape)
        return TensorMeta(key, shape, flat.dtype, label)

    def index(self) -> Index:
        return Index(self.format, str(self.src), self.raw.world_size, self._tree)

    def check_selected(self, tree: dict) -> None:
        """Refuse an optimizer subtree: each rank's holds state of its own shard, not rank 0's."""
        if not find_optimizers(tree):
            return
        where = find_optimizers(self._tree)[0]
        parts = self.raw.parts
        # Several parts (veRL's model_/optim_ files) make the tree keyed by part.
        file = self.raw.files[0][parts.index(where[0]) if where and where[0] in parts else 0]
        raise BadInputError(
            "holds optimizer state, which FSDP1's LOCAL_STATE_DICT cannot describe",
            path=file,
            hint="pass --only model, or save the optimizer with FSDP.optim_state_dict "
            "as fsdp1-sharded",
        )

    def read(
        self, metas: Sequence[TensorMeta], rows: Sequence[Rows], runtime
    ) -> list[torch.Tensor]:
        out = []
        for meta, r in zip(metas, rows):
            s = self._slices.get(meta.key)
            if s is None:
                out.append(self.raw.read([meta], [r], runtime)[0])
                continue
            row = prod(s.shape[1:])
            a, b = r if r is not None else (0, s.shape[0] if s.shape else 1)
            flat = self.raw.read([s.flat], [(s.start + a * row, s.start + b * row)], runtime)[0]
            out.append(flat.view((b - a,) + s.shape[1:] if s.shape else ()))
        return out


def _saved_orig_params(tree: dict, flats: list, layouts: dict[str, FlatLayout]) -> bool:
    """Return whether FSDP1 ran with ``use_orig_params=True``: it then saves each parameter's piece too.

    Those pieces sit beside the unit's ``_flat_param``, named by the parameters' FQNs;
    with ``use_orig_params=False`` only buffers sit there.
    """
    params = {lay.prefix + f for lay in layouts.values() for f in lay.fqns}
    parents = {p[:-1] for p, _ in flats}
    return any(p[:-1] in parents and p[-1] in params for p, _ in walk(tree))


def _replace_flat(
    tree: dict, replaced: dict[TreePath, dict[str, object]], prefix: TreePath = ()
) -> dict:
    """Return ``tree`` with each flat parameter swapped for its parameters, dropping saved pieces."""
    params = {k for p, ps in replaced.items() if p[:-1] == prefix for k in ps}
    out: dict = {}
    for k, v in tree.items():
        here = prefix + (k,)
        if here in replaced:
            out.update(replaced[here])
        elif isinstance(v, dict):
            out[k] = _replace_flat(v, replaced, here)
        elif k not in params:
            out[k] = v
    return out


def is_fsdp1_local(src: Path) -> bool:
    """Return whether directory ``src`` holds FSDP1 ``LOCAL_STATE_DICT`` rank files."""
    return detect_rank_format(src) == "fsdp1-local"


def is_fsdp1_sharded(src: Path) -> bool:
    """Return whether directory ``src`` holds FSDP1 ``SHARDED_STATE_DICT`` rank files."""
    return detect_rank_format(src) == "fsdp1-sharded"
