"""Selection, pure: which of a source's tree is written, under which keys and names.

``--only``, ``--filter``, FQN cleaning, ``--rename``/``--drop``, optimizer rekeying
(``--optim-keys``, with ``--model``'s parameter order) and re-rooting (``--nest``,
``--unnest``), applied to a source's ``Index`` in that order.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shardckpt.core.errors import BadInputError, UsageError
from shardckpt.formats.base import Index
from shardckpt.state.choices import ONLY, OPTIM_KEYS
from shardckpt.state.optim import (
    GroupError,
    ModelParams,
    OrderError,
    RekeyError,
    fqn_names,
    rekey,
)
from shardckpt.state.tree import (
    Path,
    TensorMeta,
    clean_fqn,
    dotted,
    find_optimizers,
    is_tensor_leaf,
    model_prefix,
    prune,
    rename_keys,
    split_model_optim,
    walk,
)

# What --only keeps: everything, all but optimizer subtrees, or only them.


@dataclass(frozen=True)
class FqnEdit:
    """One ``--rename`` (``repl`` given) or ``--drop`` (``repl`` None) for every FQN."""

    pattern: str
    repl: str | None = None


def parse_edit(option: str, text: str) -> FqnEdit:
    """Return the edit ``--rename REGEX=REPL`` or ``--drop REGEX`` describes; refuse bad regexes."""
    if option == "--drop":
        _compile("--drop", text, text)
        return FqnEdit(text)
    if option != "--rename":
        raise UsageError(f"unknown FQN edit {option!r}", hint="use --rename or --drop")
    # Split at the last '=': FQNs hold none, a replacement may.
    pattern, sep, repl = text.rpartition("=")
    if not sep or not pattern:
        raise UsageError(
            f"--rename {text!r} is not REGEX=REPL",
            hint="write it like --rename '^encoder\\.=backbone.'",
        )
    try:
        re.compile(pattern).sub(repl, "")
    except re.error as exc:
        raise UsageError(
            f"--rename {text!r}: bad regular expression or replacement ({exc})",
            hint="use Python re syntax; escape dots as \\.",
        ) from None
    return FqnEdit(pattern, repl)


@dataclass(frozen=True)
class Selection:
    """Which part of the source goes to DST, and how its keys are named there."""

    only: str = "all"
    filters: tuple[str, ...] = ()
    clean_fqns: bool = True
    optim_keys: str = "keep"
    edits: tuple[FqnEdit, ...] = ()
    """``--rename`` and ``--drop``, applied to every FQN in the order they were given:
    a rename is ``re.sub``; a drop removes an FQN it finds (``re.search``) with its
    optimizer state, and later edits never see it."""
    model: ModelParams | None = None
    """The parameters ``--model`` builds, for param-ID order; None: inferred from SRC."""
    unnest: str | None = None
    """``--unnest KEY``: DST's root is the subtree at top-level ``KEY`` (after the rest of
    the selection, which must leave no other top-level key)."""
    nest: str | None = None
    """``--nest KEY``: DST's root holds the selected tree under ``KEY`` (after ``unnest``)."""
    side: str = ""
    """How ``diff`` names the side these two apply to (``--unnest-a``: ``"-a"``)."""
    model_root: bool = False
    """``--only model`` to one file a model loads (``Format.model_root``), without
    ``--unnest``/``--nest``: the ``model`` subtree, where the selection has one, is DST's
    root, as ``model.load_state_dict`` takes it; what sits beside it is left out, said."""

    def __post_init__(self) -> None:
        if self.only not in ONLY:
            raise UsageError(f"--only must be all, model or optim, not {self.only!r}")
        for option, key in (
            (f"--unnest{self.side}", self.unnest),
            (f"--nest{self.side}", self.nest),
        ):
            if key is not None and not key:
                raise UsageError(f"{option} needs a key", hint=f"write it like {option} model")
        if self.optim_keys not in OPTIM_KEYS:
            raise UsageError(f"--optim-keys must be keep, fqn, id or flat, not {self.optim_keys!r}")

    def fqn_map(self, src: str = "") -> FqnEdits | None:
        """Return the ``--rename``/``--drop`` edits to apply to ``src``'s FQNs, or None for neither."""
        return FqnEdits(self.edits, src) if self.edits else None


class FqnEdits:
    """``--rename`` and ``--drop`` as applied to each FQN, each pattern read one way for all.

    A pattern that finds (``re.search``) an FQN (``blocks.3.w``, the name
    ``load_state_dict`` takes) acts on FQNs, as it always did; one that finds none acts
    on the paths ``inspect`` prints (``model.blocks.3.w``: the FQN under the keys it
    sits under), so a path copied from ``inspect`` works; one that finds neither is a
    usage error naming it. Each reads the names the edits before it left. A rename by
    path must leave a tensor under the keys it sits under. A parameter's optimizer state
    is named by its model tensor's path, so both are renamed (or dropped) alike.
    """

    def __init__(self, edits: Sequence[FqnEdit], src: str = "") -> None:
        self.edits = edits
        self.src = src
        self._compiled = [re.compile(e.pattern) for e in edits]
        self._by_path: list[bool] = []

    def plan(self, names: Sequence[tuple[str, Path]]) -> None:
        """Decide, from every ``(FQN, where its tensor sits)`` of the tree, how each pattern reads.

        Raises ``UsageError`` naming the first pattern that finds no name.
        """
        self._by_path = []
        current = list(names)
        for i, (edit, pattern) in enumerate(zip(self.edits, self._compiled)):
            if any(pattern.search(fqn) for fqn, _ in current):
                self._by_path.append(False)
            elif any(where and pattern.search(_shown(fqn, where)) for fqn, where in current):
                self._by_path.append(True)
            else:
                raise _unmatched(self.src, edit, current, first=i == 0)
            edited = [(self._edit(i, fqn, where), where) for fqn, where in current]
            current = [(fqn, where) for fqn, where in edited if fqn is not None]

    def __call__(self, fqn: str, where: Path) -> str | None:
        """Return what ``fqn``, whose tensor sits at ``where``, becomes: its new name, or None (dropped)."""
        for i in range(len(self.edits)):
            fqn = self._edit(i, fqn, where)
            if fqn is None:
                return None
        return fqn

    def _edit(self, i: int, fqn: str, where: Path) -> str | None:
        edit, pattern, by_path = self.edits[i], self._compiled[i], self._by_path[i]
        if by_path and not where:
            return fqn
        name = _shown(fqn, where) if by_path else fqn
        if edit.repl is None:
            return None if pattern.search(name) else fqn
        renamed = pattern.sub(edit.repl, name)
        if not by_path:
            return renamed
        head = _shown("", where)
        if not renamed.startswith(head) or renamed == head:
            raise UsageError(
                f"--rename '{edit.pattern}={edit.repl}' would move '{name}' to '{renamed}', "
                f"out of '{dotted(where)}'",
                path=self.src or None,
                hint=f"rename what follows '{head}' (to move a subtree, use --unnest/--nest)",
            )
        return renamed[len(head) :]


def _shown(fqn: str, where: Path) -> str:
    """Return the path ``inspect`` prints for the tensor ``fqn`` at ``where``."""
    return dotted((*where, fqn))


def _unmatched(
    src: str, edit: FqnEdit, names: Sequence[tuple[str, Path]], first: bool
) -> UsageError:
    """Return the error for ``edit``, which finds none of ``names`` (what the edits before it left)."""
    option = "--drop" if edit.repl is None else "--rename"
    text = edit.pattern if edit.repl is None else f"{edit.pattern}={edit.repl}"
    if not names:
        hint = (
            "the checkpoint holds no tensor to rename or drop"
            if first
            else "the edits before it left no tensor to match"
        )
    else:
        fqn, where = names[0]
        shown = f", or as `shardckpt inspect` prints it, '{_shown(fqn, where)}'" if where else ""
        hint = f"patterns are matched (re.search) against names such as '{fqn}'{shown}"
    return UsageError(f"{option} '{text}' matches no tensor's name", path=src, hint=hint)


def _compile(option: str, text: str, pattern: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise UsageError(
            f"{option} {text!r}: bad regular expression ({exc})",
            hint="use Python re syntax; escape dots as \\.",
        ) from None


def _collision(src: str, exc: KeyError, after: str, hint: str) -> BadInputError:
    first, second, name = exc.args[0]
    return BadInputError(
        f"'{first}' and '{second}' both become '{name}' after {after}", path=src, hint=hint
    )


def select(index: Index, selection: Selection) -> dict:
    """Return the tree DST will hold: FQN cleaning, optimizer keys and renames, ``--only``, ``--filter``."""
    return select_noting(index, selection)[0]


def select_noting(index: Index, selection: Selection) -> tuple[dict, tuple[str, ...]]:
    """Return the tree DST will hold, and the notes its re-rooting calls for (what it left out).

    Rekeying sees the whole source, so the model state that tells param IDs apart is
    there even when ``--only optim`` leaves it out of DST.
    """
    tree = index.tree
    if selection.clean_fqns:
        try:
            tree = rename_keys(tree, clean_fqn)
        except KeyError as exc:
            raise _collision(
                index.src, exc, "FQN cleaning", "pass --no-clean-fqns to keep the keys as they are"
            ) from None
    tree = _rekey(index.src, tree, selection)
    tree = split_model_optim(tree, selection.only)
    if selection.filters:
        tree = prune(tree, lambda path, _: matches(path, selection.filters))
    if not isinstance(tree, Mapping):
        tree = {}
    return reroot(dict(tree), selection, index.src)


def lift_model(tree: dict) -> tuple[dict, list[str]]:
    """Return the ``model`` subtree of ``tree`` as a root, and the top-level keys left beside it.

    ``tree`` unchanged (nothing left out) when it has no ``model`` subtree: a flat state
    dict is already what ``model.load_state_dict`` takes.
    """
    if not model_prefix(tree):
        return tree, []
    return dict(tree["model"]), [k for k in tree if k != "model"]


def _quoted(keys: Sequence[object]) -> str:
    return ", ".join(f"'{k}'" for k in keys)


def reroot(tree: dict, selection: Selection, src: str) -> tuple[dict, tuple[str, ...]]:
    """Return ``tree`` lifted out of its top-level ``--unnest`` key, then nested under ``--nest``; and notes.

    Both act on the tree the rest of the selection left, so ``--filter``, ``--only`` and
    ``--rename`` name paths as SRC has them. Lifting out a key while others remain
    beside it would drop them unseen: that is refused, naming them, unless ``--only
    model`` asked for the model state alone (a step counter beside it is left out, said).
    """
    option = f"--unnest{selection.side}"
    notes: tuple[str, ...] = ()
    if selection.model_root and selection.unnest is None and selection.nest is None:
        lifted, beside = lift_model(tree)
        if lifted is tree:
            return tree, ()
        left = f" (left out beside it: {_quoted(beside)})" if beside else ""
        return lifted, (
            "--only model to one file: DST's root is the 'model' subtree, as "
            f"model.load_state_dict takes it{left}; --filter 'model.*' keeps the 'model' key",
        )
    if selection.unnest is not None:
        key = selection.unnest
        if key not in tree:
            have = ", ".join(f"'{k}'" for k in tree) or "none"
            raise UsageError(
                f"{option} {key}: the selected tree has no top-level '{key}' (it has {have})",
                path=src,
                hint="pass one of its top-level keys (`shardckpt inspect` shows them)",
            )
        value = tree[key]
        if not isinstance(value, Mapping):
            what = "tensor" if isinstance(value, TensorMeta) else type(value).__name__
            raise UsageError(
                f"{option} {key}: '{key}' is a {what}, not a subtree",
                path=src,
                hint="pass a top-level key that holds a dict",
            )
        others = [k for k in tree if k != key]
        if others and selection.only != "model":
            raise UsageError(
                f"{option} {key} would leave out the other top-level keys beside it: "
                f"{_quoted(others)}",
                path=src,
                hint=f"select '{key}' alone first, e.g. --filter '{key}.*' (or --only model)",
            )
        if others:
            notes = (
                f"{option} {key} leaves out what --only model kept beside it: {_quoted(others)}",
            )
        tree = dict(value)
    if selection.nest is not None:
        tree = {selection.nest: tree}
    return tree, notes


def _rekey(src: str, tree: dict, selection: Selection) -> dict:
    """Return ``tree`` with ``--rename``/``--drop`` applied and optimizers keyed as asked."""
    fqn_map = selection.fqn_map(src)
    if selection.optim_keys == "keep" and fqn_map is None:
        return tree
    if selection.optim_keys != "keep" and not find_optimizers(tree):
        raise UsageError(
            f"--optim-keys {selection.optim_keys}: the checkpoint holds no optimizer state",
            path=src,
            hint="drop --optim-keys (it applies to dicts with 'state' and 'param_groups')",
        )
    if fqn_map is not None:
        fqn_map.plan(fqn_names(tree))
    try:
        out = rekey(tree, selection.optim_keys, fqn_map, selection.model)
    except KeyError as exc:
        raise _collision(
            src, exc, "--rename/--drop", "change the --rename patterns so names stay distinct"
        ) from None
    except OrderError as exc:
        hint = (
            "check that --model builds the trained model and its param groups"
            if selection.model is not None
            else "pass --model pkg.module:factory returning (module, param_groups)"
        )
        what = (
            "the param groups of a flattened optimizer"
            if isinstance(exc, GroupError)
            else "the FQN of each optimizer param ID"
        )
        raise UsageError(f"cannot tell {what}: {exc}", path=src, hint=hint) from None
    except RekeyError as exc:
        raise BadInputError(
            f"inconsistent optimizer state: {exc}",
            path=src,
            hint="check the optimizer with `shardckpt inspect`",
        ) from None
    return out


def _holds_tensor(value: object) -> bool:
    if is_tensor_leaf(value):
        return True
    if isinstance(value, Mapping):
        return any(_holds_tensor(k) or _holds_tensor(v) for k, v in value.items())
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_holds_tensor(v) for v in value)
    return False


def check_values(tree: dict, src: str) -> None:
    """Refuse a plain value that holds tensors: no writer can stream tensors from inside one.

    Tensors are carried where DCP's traversal finds them, in dicts and lists; a tensor
    inside a tuple (or a set) is part of a value, and would be pickled whole or lost.
    """
    for path, leaf in walk(tree):
        if not isinstance(leaf, TensorMeta) and _holds_tensor(leaf):
            raise BadInputError(
                f"'{dotted(path)}' is a {type(leaf).__name__} holding tensors, "
                "which shardckpt cannot carry",
                path=src,
                hint="keep tensors in dicts and lists, or leave this out with --filter/--only",
            )


def matches(path: Path, globs: Sequence[str]) -> bool:
    """Return whether the dotted form of ``path`` matches any glob (no globs: everything)."""
    name = dotted(path)
    return not globs or any(fnmatch.fnmatchcase(name, g) for g in globs)
