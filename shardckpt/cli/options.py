"""Option types shared by the commands, their choices, and the one stdout sink."""

from __future__ import annotations

import re
from typing import Annotated

import typer

from shardckpt import __version__
from shardckpt.cli.help import HelpCommand
from shardckpt.core import streams
from shardckpt.core.errors import IOFailure, UsageError, notice
from shardckpt.core.rank_env import env_rank
from shardckpt.core.words import closest
from shardckpt.formats import FORMATS
from shardckpt.state.choices import LAYOUTS, ONLY


def _not_a_choice(option: str, value: str, values: tuple[str, ...]) -> UsageError:
    """Return the usage error for ``value`` given to ``option``, which takes one of ``values``."""
    if values == LAYOUTS:
        message = f"{option} {value!r} is not a layout (full, sharded or local)"
    else:
        message = f"{option} {value!r} is not one of {', '.join(values)}"
    form = FORMATS.get(value) if values == LAYOUTS else None
    if form is not None:
        # `--to dcp`: a format given where its layout is asked for.
        if form.default_for == form.layout:
            hint = f"{value} is the default format of --to {form.layout}: pass --to {form.layout}"
        else:
            hint = f"{value} is a format of --to {form.layout}: pass --to {form.layout} --format {value}"
    elif (guess := closest(value, values)) is not None:
        hint = f"did you mean {option} {guess}?"
    else:
        hint = f"pass one of {', '.join(values)}"
    return UsageError(message, hint=hint)


def choice(option: str, values: tuple[str, ...], help: str, **more) -> typer.Option:
    """Return an option that takes one of ``values``; another value is refused with a hint."""

    def check(value: str | None) -> str | None:
        if value is not None and value not in values:
            raise _not_a_choice(option, value, values)
        return value

    return typer.Option(option, metavar="|".join(values), help=help, callback=check, **more)


ALL_FORMATS = ", ".join(FORMATS)


def output_formats() -> str:
    """Return the formats each layout is written in, its default first: 'full: torch, ...; sharded: ...'."""
    by_layout = []
    for layout in LAYOUTS:
        written = [f for f in FORMATS.values() if f.layout == layout and f.written]
        written.sort(key=lambda f: f.default_for != layout)
        by_layout.append(f"{layout}: {', '.join(f.name for f in written)}")
    return "; ".join(by_layout)


def only_option(help: str):
    """Return the option type of ``--only``: all, model or optim."""
    return Annotated[str, choice("--only", ONLY, help)]


OnlyOpt = only_option("model: all but optimizers; optim: optimizers only.")

# The source-format option is ``--from`` in every command (``--from-a``/``--from-b`` in
# diff), as convert spells it; convert's ``--format`` is the output's. The spellings
# inspect, verify and diff had before still work, unlisted in --help and with a note.
OLD_SPELLINGS = {"--format": "--from", "--format-a": "--from-a", "--format-b": "--from-b"}


def source_format_option(name: str, help: str) -> typer.Option:
    """Return the source-format option ``name`` (``--from``), its old spelling an unlisted alias."""
    old = next(o for o, new in OLD_SPELLINGS.items() if new == name)
    return typer.Option(name, old, metavar="FORMAT", help=help)


# Option types shared by the commands.
SrcFormat = Annotated[
    str | None,
    source_format_option("--from", f"Source format (default: detected): {ALL_FORMATS}."),
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
BufferSize = Annotated[
    str,
    typer.Option(
        "--buffer-size", metavar="SIZE", help="Most tensor bytes a process holds at a time."
    ),
]
Threads = Annotated[
    int | None,
    typer.Option("--threads", metavar="N", help="Threads per process (default: its cores)."),
]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar and no summary line.")]
StorageOptions = Annotated[
    list[str] | None,
    typer.Option(
        "--storage-option",
        metavar="KEY=VALUE",
        help="Option of the filesystem behind a URL (s3://...); repeatable; docs/storage.md.",
    ),
]
TrustPickle = Annotated[
    bool,
    typer.Option(
        "--trust-pickle", help="Allow pickles that run code when loaded (only for files you trust)."
    ),
]
DeviceOpt = Annotated[
    str | None,
    choice(
        "--device",
        ("cpu", "cuda"),
        "Under torchrun: cpu, or cuda (a GPU per rank); default: cuda if all have one.",
    ),
]
CleanFqns = Annotated[
    bool,
    typer.Option(
        "--clean-fqns/--no-clean-fqns",
        help="Strip wrappers from FQNs (FSDP, compile, DDP's 'module.').",
    ),
]
Wraps = Annotated[
    list[str] | None,
    typer.Option(
        "--wrap",
        metavar="pkg.module:Class",
        help="A class FSDP1's ModuleWrapPolicy wrapped (repeatable; with --model, for "
        "fsdp1-local).",
    ),
]


def _reroot_option(name: str, help: str):
    """Return the option type of ``--unnest``/``--nest``: one top-level key."""
    return Annotated[str | None, typer.Option(name, metavar="KEY", help=help)]


Unnest = _reroot_option("--unnest", "DST's root is the subtree at top-level KEY.")
Nest = _reroot_option(
    "--nest", "DST holds the tree under top-level KEY: a flat state dict -> {KEY: ...}."
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


def emit(text: str, finished: str = "") -> None:
    """Print on stdout from rank 0 only (SPEC: only rank 0 prints); raise (exit 4) when it cannot.

    ``finished``: what the run did that stands, said when the output is lost.
    """
    if env_rank() != 0:
        return
    try:
        streams.out(text)
    except OSError as exc:
        raise IOFailure(
            f"the output could not be written ({exc.strerror or type(exc).__name__})",
            path=STDOUT,
            hint=f"{finished}: only what it printed is lost"
            if finished
            else "write stdout where there is room, or run again",
        ) from None


def will_emit() -> None:
    """Raise (exit 4) when stdout is closed on rank 0: the command has output to print there.

    A ``Runtime.check``, run before any work: every rank stops with the one line.
    """
    if env_rank() == 0 and streams.stdout_closed():
        raise IOFailure(
            "is closed",
            path=STDOUT,
            hint="run it with stdout open (not `>&-`), or with -q where it has one",
        )


STDOUT = "<stdout>"
"""What an error about the standard output names as its file."""


def emit_notes(notes) -> None:
    """Print each note on stderr (``shardckpt: note: ...``) from rank 0 only."""
    if env_rank() == 0:
        for note in notes:
            notice(note)


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


class RawArgsCommand(HelpCommand):
    """A command that keeps its raw arguments and refuses a single-valued option given twice.

    Click keeps the last of a repeated option silently (``--only model --only optim``
    means optim); the raw arguments also keep how repeatable options interleave.
    """

    def parse_args(self, ctx, args):
        ctx.meta[_RAW_ARGS] = list(args)
        rest = super().parse_args(ctx, args)
        _refuse_repeats(ctx)
        emit_notes(_old_spellings(ctx))
        return rest

    def listed_names(self, param) -> list[str]:
        """Return the names ``--help`` lists for ``param``: all but an old spelling beside its new one."""
        names = super().listed_names(param)
        return [n for n in names if OLD_SPELLINGS.get(n) not in names]


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


def _old_spellings(ctx) -> list[str]:
    """Return a note for each old spelling of an option in the raw arguments (``--format``)."""
    params = _option_params(ctx)
    return [
        f"{name} is spelled {new} now ({ctx.info_name} {name} still works)"
        for name, _ in _given(ctx)
        if (new := OLD_SPELLINGS.get(name)) in params and params[new] is params[name]
    ]


def in_given_order(ctx: typer.Context, names: tuple[str, ...]) -> list[tuple[str, str]]:
    """Return ``(option, value)`` for each use of the options ``names``, in command-line order.

    Click groups a repeatable option's values per option and loses how two options
    interleave; the raw arguments keep it.
    """
    return [(name, value) for name, value in _given(ctx) if name in names]
