"""Option types shared by the commands, their choices, and the one stdout sink."""

from __future__ import annotations

import re
from enum import Enum
from typing import Annotated

import typer
from typer.core import TyperCommand

from shardckpt import __version__
from shardckpt.core.errors import UsageError
from shardckpt.core.rank_env import env_rank
from shardckpt.formats import FORMATS
from shardckpt.state.choices import LAYOUTS, ONLY, OPTIM_KEYS


def _choices(name: str, values) -> type[Enum]:
    """Return a str Enum of ``values`` for Typer, so each option's choices live in one place."""
    return Enum(name, {v: v for v in values}, type=str)


Layout = _choices("Layout", LAYOUTS)
Only = _choices("Only", ONLY)
OptimKeys = _choices("OptimKeys", OPTIM_KEYS)
Device = _choices("Device", ("cpu", "cuda"))
ALL_FORMATS = ", ".join(FORMATS)

# Option types shared by the commands.
SrcFormat = Annotated[
    str | None,
    typer.Option(
        "--format", metavar="FORMAT", help=f"Source format (default: detected): {ALL_FORMATS}."
    ),
]
Filters = Annotated[
    list[str] | None,
    typer.Option(
        "--filter",
        metavar="GLOB",
        help="Keep leaves whose dotted path matches this glob (repeatable).",
    ),
]
JsonOut = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar and no summary line.")]
TrustPickle = Annotated[
    bool,
    typer.Option(
        "--trust-pickle", help="Allow pickles that run code when loaded (only for files you trust)."
    ),
]
DeviceOpt = Annotated[
    Device | None,
    typer.Option(
        "--device",
        help="Under torchrun: cpu, or cuda (every rank needs a GPU of its own); "
        "default: cuda when every rank has one, else cpu.",
    ),
]
CleanFqns = Annotated[
    bool,
    typer.Option(
        "--clean-fqns/--no-clean-fqns",
        help="Strip _fsdp_wrapped_module., _checkpoint_wrapped_module., _orig_mod. and a DDP module. prefix.",
    ),
]
Wraps = Annotated[
    list[str] | None,
    typer.Option(
        "--wrap",
        metavar="pkg.module:Class",
        help="pkg.module:Class that FSDP1's ModuleWrapPolicy wrapped (repeatable); "
        "with --model, gives fsdp1-local flat-parameter layouts (only those).",
    ),
]


def _reroot_option(name: str, help: str):
    """Return the option type of ``--unnest``/``--nest``: one top-level key."""
    return Annotated[str | None, typer.Option(name, metavar="KEY", help=help)]


Unnest = _reroot_option(
    "--unnest",
    "Make the subtree at top-level KEY the root (e.g. a Trainer checkpoint's state_dict); "
    "any other top-level key left by the selection is an error.",
)
Nest = _reroot_option(
    "--nest",
    "Put the selected tree under top-level KEY (a flat state_dict -> {KEY: ...}, as DCP "
    "loaders expect); after --unnest.",
)


def _print_version(value: bool) -> None:
    if value:
        emit(f"shardckpt {__version__}")
        raise typer.Exit()


Version = Annotated[
    bool,
    typer.Option(
        "--version",
        is_eager=True,
        expose_value=False,
        callback=_print_version,
        help="Print shardckpt's version and exit.",
    ),
]
HELP_OPTIONS = {"help_option_names": ["-h", "--help"]}
"""``-h`` is ``--help`` for the app and every command."""


def emit(text: str) -> None:
    """Print on stdout from rank 0 only (SPEC: only rank 0 prints)."""
    if env_rank() == 0:
        typer.echo(text)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}


def parse_size(text: str, option: str) -> int:
    """Return the byte count of ``text`` such as ``512MB``, ``2GiB`` or ``1000``."""
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise UsageError(
            f"{option} {text!r} is not a size", hint="write it like 512MB, 2GiB or 1000000"
        )
    return int(float(m.group(1)) * _UNITS[unit])


_RAW_ARGS = "shardckpt.raw_args"


class RawArgsCommand(TyperCommand):
    """A command that keeps its raw arguments and refuses a single-valued option given twice.

    Click keeps the last of a repeated option silently (``--only model --only optim``
    means optim); the raw arguments also keep how repeatable options interleave.
    """

    def parse_args(self, ctx, args):
        ctx.meta[_RAW_ARGS] = list(args)
        rest = super().parse_args(ctx, args)
        _refuse_repeats(ctx)
        return rest


def _option_params(ctx) -> dict[str, object]:
    """Return each option name of the command (both spellings of a flag pair) -> its parameter."""
    return {
        name: p
        for p in ctx.command.params
        if getattr(p, "param_type_name", "") == "option"
        for name in (*p.opts, *p.secondary_opts)
    }


def _given(ctx) -> list[tuple[str, str]]:
    """Return ``(option, value)`` for every option in the raw arguments, in command-line order.

    Another option's value is skipped, so a value that happens to read ``--drop`` is
    not mistaken for the option.
    """
    params = _option_params(ctx)
    found: list[tuple[str, str]] = []
    args = iter(ctx.meta.get(_RAW_ARGS, ()))
    for arg in args:
        if arg == "--":
            break
        name, eq, value = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        param = params.get(name)
        if param is None:
            continue
        takes_value = not (getattr(param, "is_flag", False) or getattr(param, "count", False))
        found.append((name, value if eq or not takes_value else next(args, "")))
    return found


def _refuse_repeats(ctx) -> None:
    """Raise a usage error for a single-valued option (or flag) given more than once."""
    params = _option_params(ctx)
    seen: dict[int, str] = {}
    for name, _ in _given(ctx):
        param = params[name]
        if getattr(param, "multiple", False):
            continue
        if id(param) not in seen:
            seen[id(param)] = name
            continue
        first = seen[id(param)]
        if name == first:
            raise UsageError(
                f"{name} given more than once",
                hint="pass it once: it is not repeatable, and only the last would count",
            )
        raise UsageError(f"{first} and {name} both given", hint="keep one of them")


def in_given_order(ctx: typer.Context, names: tuple[str, ...]) -> list[tuple[str, str]]:
    """Return ``(option, value)`` for each use of the options ``names``, in command-line order.

    Click groups a repeatable option's values per option and loses how two options
    interleave; the raw arguments keep it.
    """
    return [(name, value) for name, value in _given(ctx) if name in names]
