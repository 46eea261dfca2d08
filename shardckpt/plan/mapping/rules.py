"""A mapping file read and checked: names of one checkpoint family to Hugging Face's, and the operations between.

A mapping is data (``maps/*.toml``, or the user's own file for ``--map path.toml``),
written in the direction source -> Hugging Face and applied either way
(``plan.mapping.layout``). Its parts:

- ``sizes``: each size the rules use, read from ``config.json`` (the first key present);
- ``ranges``: the indices a placeholder runs over, ``[stop]`` or ``[start, stop]``, in sizes;
- ``flags``: each switch the rules use, read from ``config.json`` (the first key
  present; absent is off);
- ``tensors``: one rule per tensor family: ``from`` (source name), ``to`` (Hugging Face
  name), placeholders ``{range}`` in both, and at most one operation: ``rope = "SIZE"``
  (torchtitan's RoPE row order to Hugging Face's, over SIZE heads) or
  ``unstack = "RANGE"`` or ``["RANGE", ...]`` (the source's leading dims hold one tensor
  per index of each RANGE, which
  only ``to`` names: grouped experts, one weight per expert). ``unless = "FLAG"`` leaves
  the rule out where the config sets FLAG: an output layer tied to the embedding is
  stored by neither side.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path

from shardckpt.core.errors import BadInputError, UsageError
from shardckpt.core.files import os_error, source_file

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_KEYS = ("from", "to", "rope", "unstack", "split", "heads", "groups", "unless")
_SPLITS = ("chunks", "qkv")


@dataclass(frozen=True)
class Rule:
    """One tensor family: source name pattern, Hugging Face name pattern(s), and its operations."""

    source: str
    targets: tuple[str, ...]
    """One name pattern, or one per part of a ``split``."""
    rope: str | None = None
    """The size naming how many heads the rows are in (torchtitan's RoPE order to HF's)."""
    unstack: tuple[str, ...] = ()
    """The ranges the source's leading dims run over (a layer axis, then an expert
    axis), one target tensor per combination of indices."""
    split: str | None = None
    """How the rows of the source (of each unstacked part) divide among ``targets``:
    ``chunks`` (equal parts, in order: SwiGLU's fused gate and up) or ``qkv``
    (Megatron's fused QKV: per key/value group, its query heads' rows, then one key
    head's, then one value head's)."""
    heads: str | None = None
    """For ``split = "qkv"``: the size counting query heads."""
    groups: str | None = None
    """For ``split = "qkv"``: the size counting key/value heads (query groups)."""
    unless: str | None = None
    """The flag that, set in the config, leaves this rule out (a tied output layer)."""

    def placeholders(self, side: str, i: int = 0) -> list[str]:
        """Return the range names ``side`` (``source``, or target ``i``) names, in order."""
        return _PLACEHOLDER.findall(self.source if side == "source" else self.targets[i])


@dataclass(frozen=True)
class ArchMap:
    """A mapping file: which sources and architectures it is for, its sizes, ranges and rules."""

    name: str
    file: Path
    description: str
    sources: tuple[str, ...]
    """The source formats whose names ``from`` patterns are (chosen by default for them)."""
    architectures: tuple[str, ...]
    """The ``config.json`` ``architectures`` it is chosen by, by default."""
    sizes: Mapping[str, tuple[str, ...]]
    ranges: Mapping[str, tuple[str, ...]]
    rules: tuple[Rule, ...]
    flags: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def for_config(self, config: Mapping) -> ArchMap:
        """Return this mapping less the rules whose ``unless`` flag ``config`` sets."""
        on = {
            flag
            for flag, keys in self.flags.items()
            if next((config[k] for k in keys if k in config), False) is True
        }
        return replace(self, rules=tuple(r for r in self.rules if r.unless not in on))

    def sizes_from(self, config: Mapping, where: str) -> dict[str, int]:
        """Return each size read from ``config`` (a ``config.json``); refuse one it lacks."""
        out = {}
        for size, keys in self.sizes.items():
            value = next((config[k] for k in keys if k in config), None)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise BadInputError(
                    f"has no whole number under {' or '.join(repr(k) for k in keys)}, which "
                    f"mapping '{self.name}' needs for its size '{size}'",
                    path=where,
                    hint="pass --hf-config the directory of the model these weights belong to",
                )
            out[size] = value
        return out

    def range_values(self, sizes: Mapping[str, int]) -> dict[str, range]:
        """Return the indices each range runs over, at ``sizes``."""
        out = {}
        for name, bounds in self.ranges.items():
            ends = [sizes[b] if b in sizes else int(b) for b in bounds]
            out[name] = range(*ends) if len(ends) == 2 else range(ends[0])
        return out


def shipped() -> dict[str, Path]:
    """Return the mappings shardckpt ships, by name."""
    folder = resources.files(__package__).joinpath("maps")
    return {
        Path(str(entry)).stem: Path(str(entry))
        for entry in sorted(folder.iterdir(), key=lambda e: e.name)
        if entry.name.endswith(".toml")
    }


def load(spec: str) -> ArchMap:
    """Return the mapping ``--map spec`` names: a shipped one by name, or a ``.toml`` file."""
    maps = shipped()
    if spec in maps:
        return read(maps[spec])
    if not spec.endswith(".toml"):
        raise UsageError(
            f"--map {spec!r}: no such mapping",
            hint=f"name one of {', '.join(maps)}, or a mapping file ending in .toml",
        )
    return read(Path(spec))


def maps_from(src_format: str) -> bool:
    """Return whether a shipped mapping maps the names of ``src_format`` checkpoints by default."""
    return any(src_format in read(path).sources for path in shipped().values())


def chosen(src_format: str, architectures: object, names: Collection[str]) -> ArchMap | None:
    """Return the shipped mapping for ``src_format`` and ``config.json``'s ``architectures`` that names most of ``names``; None when none fits."""
    if not isinstance(architectures, list):
        return None
    for path in shipped().values():
        amap = read(path)
        if src_format in amap.sources and set(amap.architectures) & set(architectures):
            patterns = [_pattern(rule.source) for rule in amap.rules]
            # Most of SRC's names must be the mapping's: a Hugging Face model saved by FSDP
            # shares a name or two with a trainer's (lm_head.weight), and is not mapped.
            matched = sum(1 for name in names if any(p.fullmatch(name) for p in patterns))
            if 2 * matched > len(names):
                return amap
    return None


def _pattern(text: str) -> re.Pattern:
    """Return the regex a name pattern is: each ``{range}`` an index without leading zeros."""
    parts = _PLACEHOLDER.split(text)
    out = []
    for i, part in enumerate(parts):
        out.append(f"(?P<{part}>0|[1-9][0-9]*)" if i % 2 else re.escape(part))
    return re.compile("".join(out))


def pattern(rule: Rule, side: str, i: int = 0) -> re.Pattern:
    """Return the regex of ``rule``'s ``side`` names (``source``, or target ``i``)."""
    return _pattern(rule.source if side == "source" else rule.targets[i])


def read(path: Path) -> ArchMap:
    """Return the mapping in ``path``, checked; refuse a file that is not one (one line naming it)."""
    try:
        data = tomllib.loads(source_file(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise os_error(exc, path) from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise _bad(path, f"is not TOML ({exc})") from None
    try:
        return _checked(path, data)
    except (KeyError, TypeError, ValueError) as exc:
        raise _bad(path, f"is not a mapping ({type(exc).__name__}: {exc})") from None


def _bad(path: Path, what: str) -> BadInputError:
    return BadInputError(
        what,
        path=path,
        hint="write it as docs/trainers/mappings.md describes, or name a shipped mapping",
    )


def _strings(value: object, what: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value) or not value:
        raise ValueError(f"{what} is not a list of strings")
    return tuple(value)


def _checked(path: Path, data: dict) -> ArchMap:
    sizes = {k: _strings(v, f"sizes.{k}") for k, v in data.get("sizes", {}).items()}
    ranges = {k: _strings(v, f"ranges.{k}") for k, v in data.get("ranges", {}).items()}
    flags = {k: _strings(v, f"flags.{k}") for k, v in data.get("flags", {}).items()}
    for name, bounds in ranges.items():
        if len(bounds) > 2 or any(b not in sizes and not b.isdigit() for b in bounds):
            raise ValueError(f"ranges.{name} is not [stop] or [start, stop] of sizes")
    rules = []
    for i, entry in enumerate(data["tensors"]):
        extra = set(entry) - set(_KEYS)
        if extra or ("rope" in entry and ("unstack" in entry or "split" in entry)):
            raise ValueError(f"tensors[{i}] has {sorted(extra) or 'rope with another operation'}")
        to = entry["to"]
        targets = tuple(to) if isinstance(to, list) else (to,)
        rule = Rule(
            str(entry["from"]),
            tuple(str(t) for t in targets),
            entry.get("rope"),
            _unstacked(entry.get("unstack")),
            entry.get("split"),
            entry.get("heads"),
            entry.get("groups"),
            entry.get("unless"),
        )
        _check_rule(i, rule, sizes, ranges)
        if rule.unless is not None and rule.unless not in flags:
            raise ValueError(f"tensors[{i}] names flag {rule.unless!r}, which flags lacks")
        rules.append(rule)
    return ArchMap(
        name=str(data.get("name", path.stem)),
        file=path,
        description=str(data.get("description", "")),
        sources=tuple(data.get("sources", ())),
        architectures=tuple(data.get("architectures", ())),
        sizes=sizes,
        ranges=ranges,
        rules=tuple(rules),
        flags=flags,
    )


def _check_rule(i: int, rule: Rule, sizes: dict, ranges: dict) -> None:
    """Raise ``ValueError`` for a rule whose names, operations or sizes do not fit together."""
    src = rule.placeholders("source")
    for size in (rule.rope, rule.heads, rule.groups):
        if size is not None and size not in sizes:
            raise ValueError(f"tensors[{i}] names size {size!r}, which sizes lacks")
    if rule.split is None and len(rule.targets) != 1:
        raise ValueError(f"tensors[{i}] has several 'to' names and no split")
    if rule.split is not None:
        if rule.split not in _SPLITS:
            raise ValueError(f"tensors[{i}] split {rule.split!r} is not one of {list(_SPLITS)}")
        if rule.split == "qkv" and (len(rule.targets) != 3 or not rule.heads or not rule.groups):
            raise ValueError(f"tensors[{i}] split 'qkv' takes three 'to' names, heads and groups")
    for t in range(len(rule.targets)):
        dst = rule.placeholders("target", t)
        unknown = [p for p in src + dst if p not in ranges]
        if unknown:
            raise ValueError(f"tensors[{i}] names range {unknown[0]!r}, which ranges lacks")
        if sorted(src + list(rule.unstack)) != sorted(dst):
            raise ValueError(
                f"tensors[{i}]: 'to' must name the placeholders of 'from', plus the unstacked ones"
            )
        if len(set(dst)) != len(dst) or len(set(src)) != len(src):
            raise ValueError(f"tensors[{i}] names a placeholder twice")


def _unstacked(value: object) -> tuple[str, ...]:
    """Return ``unstack``'s ranges: none, one name, or a list of names (leading dim first)."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return _strings(value, "unstack")
