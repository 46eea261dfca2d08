"""The Typer app: parse options, call ``shardckpt.api``, render. Nothing else lives here."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from enum import Enum
from typing import Annotated

import typer

from shardckpt import api, render
from shardckpt.cast import DTYPES
from shardckpt.dist import env_rank, launch
from shardckpt.errors import EXIT_DIFFERENT, IOFailure, RemoteRankError, ShardckptError, UsageError
from shardckpt.formats import READERS
from shardckpt.optim import OPTIM_KEYS
from shardckpt.plan import ONLY
from shardckpt.progress import Progress

app = typer.Typer(
    name="shardckpt",
    help="Convert PyTorch training checkpoints between layouts, formats and world sizes.\n\n"
    "Run standalone, or under torchrun to spread the work over ranks:\n\n"
    "  torchrun --nproc-per-node 4 -m shardckpt convert ckpt/step-100 full.pt --to full",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _choices(name: str, values) -> type[Enum]:
    """Return a str Enum of ``values`` for Typer, so each option's choices live in one place."""
    return Enum(name, {v: v for v in values}, type=str)


Layout = _choices("Layout", api.LAYOUTS)
Only = _choices("Only", ONLY)
Dtype = _choices("Dtype", DTYPES)
OptimKeys = _choices("OptimKeys", OPTIM_KEYS)
Device = _choices("Device", ("cpu", "cuda"))
ALL_FORMATS = ", ".join(READERS)

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
        help="Under torchrun: cpu (gloo) or cuda (nccl); default: cuda when every rank has a GPU.",
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
        "with --model, gives fsdp1-local flat-parameter layouts.",
    ),
]


def _emit(text: str) -> None:
    """Print on stdout from rank 0 only (SPEC: only rank 0 prints)."""
    if env_rank() == 0:
        typer.echo(text)


@app.command(
    epilog="Examples:\n\n  shardckpt inspect ckpt/step-100\n\n  shardckpt inspect model.safetensors --json --filter 'model.layers.0.*'"
)
def inspect(
    src: Annotated[
        str,
        typer.Argument(
            metavar="SRC", help="Checkpoint: DCP directory, .pt/.bin file or .safetensors file."
        ),
    ],
    fmt: SrcFormat = None,
    filters: Filters = None,
    shards: Annotated[
        bool, typer.Option("--shards", help="List every stored shard: rank, offsets, sizes.")
    ] = False,
    json_out: JsonOut = False,
    trust_pickle: TrustPickle = False,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            metavar="pkg.module:factory",
            help="pkg.module:factory; names what fsdp1-local flat params hold.",
        ),
    ] = None,
    wraps: Wraps = None,
) -> int:
    """Show what a checkpoint holds, from metadata only: leaves, shapes, dtypes, layouts, optimizers."""
    with launch("cpu") as runtime:
        result = api.inspect(
            src,
            fmt=fmt,
            filters=filters or (),
            trust_pickle=trust_pickle,
            model=model,
            wraps=wraps or (),
            runtime=runtime,
        )
    _emit(
        json.dumps(render.inspection_json(result, shards))
        if json_out
        else render.inspection_text(result, shards)
    )
    return 0


@app.command(
    epilog="Examples:\n\n  shardckpt convert ckpt/step-100 full.pt --to full\n\n"
    "  torchrun --nproc-per-node 2 -m shardckpt convert ckpt/step-100 model.safetensors --to full --only model\n\n"
    "  torchrun --nproc-per-node 4 -m shardckpt convert full.pt ckpt-dcp --to sharded\n\n"
    "  shardckpt convert ckpt/step-100 ranks-at-2 --to local --world-size 2\n\n"
    "  shardckpt convert ckpt/step-100 hf-model --to full --format hf --dtype bf16"
    "\n\n"
    "  shardckpt convert ckpt/step-100 plain.pt --to full --optim-keys id --model train:build\n\n"
    "  shardckpt convert fsdp1-local-ckpt full.pt --to full --model train:build --wrap train:Block\n\n"
    "  shardckpt convert full.pt small.pt --to full --drop '^blocks\\.3\\.' --rename '^blocks\\.4\\.=blocks.3.'"
)
def convert(
    src: Annotated[
        str, typer.Argument(metavar="SRC", help="Source checkpoint (format detected; see --from).")
    ],
    dst: Annotated[
        str,
        typer.Argument(
            metavar="DST", help="Destination; written beside its name and renamed when complete."
        ),
    ],
    to: Annotated[
        Layout,
        typer.Option(
            "--to",
            help="Layout of DST: full (one file), sharded (DCP, one file per rank of --world-size) "
            "or local (per-rank files of one world size: --format fsdp2-ranks (default), "
            "fsdp1-sharded, fsdp1-local).",
        ),
    ],
    fmt: Annotated[
        str | None,
        typer.Option(
            "--format",
            metavar="FORMAT",
            help="Output format; default: torch, or safetensors for *.safetensors; dcp for sharded; "
            "fsdp2-ranks for local. Also: hf (a Hugging Face directory of safetensors shards, "
            "model state only), fsdp1-sharded, fsdp1-local.",
        ),
    ] = None,
    src_format: Annotated[
        str | None,
        typer.Option(
            "--from",
            metavar="FORMAT",
            help=f"Source format, when detection is not wanted: {ALL_FORMATS}.",
        ),
    ] = None,
    world_size: Annotated[
        int | None,
        typer.Option(
            "--world-size",
            metavar="M",
            help="Ranks of a sharded or local DST, any M >= 1, whatever the launch (default: the launch's).",
        ),
    ] = None,
    only: Annotated[
        Only, typer.Option("--only", help="all, model (everything but optimizers) or optim.")
    ] = Only["all"],
    filters: Filters = None,
    clean_fqns: CleanFqns = True,
    dtype: Annotated[
        Dtype,
        typer.Option(
            "--dtype", help="Cast model floating-point tensors (ints and bools stay as they are)."
        ),
    ] = Dtype["keep"],
    cast_optim: Annotated[
        bool,
        typer.Option(
            "--cast-optim",
            help="With --dtype: also cast optimizer floating state (never its 'step' counters).",
        ),
    ] = False,
    max_shard_size: Annotated[
        str | None,
        typer.Option(
            "--max-shard-size",
            metavar="SIZE",
            help="For --format hf: the most tensor bytes per shard (default 5GB).",
        ),
    ] = None,
    optim_keys: Annotated[
        OptimKeys,
        typer.Option(
            "--optim-keys",
            help="Key optimizer state by param ID (plain torch.optim), by FQN (FSDP/DCP), or keep.",
        ),
    ] = OptimKeys["keep"],
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            metavar="pkg.module:factory",
            help="pkg.module:factory returning the module or (module, param_groups); "
            "gives the order of param IDs.",
        ),
    ] = None,
    wraps: Wraps = None,
    use_orig_params: Annotated[
        bool,
        typer.Option(
            "--use-orig-params",
            help="For --format fsdp1-local: the layout of FSDP1 with use_orig_params=True.",
        ),
    ] = False,
    renames: Annotated[
        list[str] | None,
        typer.Option(
            "--rename",
            metavar="REGEX=REPL",
            help="'REGEX=REPL' applied (re.sub) to every FQN, model and optimizer alike (repeatable).",
        ),
    ] = None,
    drops: Annotated[
        list[str] | None,
        typer.Option(
            "--drop",
            metavar="REGEX",
            help="Drop every FQN this regex finds, with its optimizer state (repeatable).",
        ),
    ] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace an existing DST.")
    ] = False,
    verify: Annotated[
        bool, typer.Option("--verify", help="Re-read DST and compare every value with SRC.")
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the plan; write nothing.")
    ] = False,
    buffer_size: Annotated[
        str,
        typer.Option(
            "--buffer-size", metavar="SIZE", help="Bytes of tensors moved per batch (e.g. 256MiB)."
        ),
    ] = "256MiB",
    json_out: JsonOut = False,
    quiet: Quiet = False,
    trust_pickle: TrustPickle = False,
    device: DeviceOpt = None,
) -> int:
    """Convert a checkpoint into another layout or format, exactly (bit-identical values)."""
    with launch(device.value if device else None) as runtime:
        result = api.convert(
            src,
            dst,
            to=to.value,
            fmt=fmt,
            src_format=src_format,
            world_size=world_size,
            only=only.value,
            filters=filters or (),
            clean_fqns=clean_fqns,
            dtype=dtype.value,
            cast_optim=cast_optim,
            max_shard_size=(
                parse_size(max_shard_size, "--max-shard-size")
                if max_shard_size is not None
                else None
            ),
            optim_keys=optim_keys.value,
            renames=renames or (),
            drops=drops or (),
            model=model,
            wraps=wraps or (),
            use_orig_params=use_orig_params,
            overwrite=overwrite,
            dry_run=dry_run,
            verify=verify,
            trust_pickle=trust_pickle,
            buffer_bytes=parse_size(buffer_size, "--buffer-size"),
            runtime=runtime,
            progress=Progress(
                enabled=runtime.coordinator and not quiet and not json_out, desc="convert"
            ),
        )
    if json_out:
        _emit(json.dumps(render.convert_json(result)))
    elif not quiet or dry_run:
        _emit(render.convert_text(result))
    return 0


@app.command(
    epilog="Examples:\n\n  shardckpt diff ckpt/step-100 full.pt\n\n  shardckpt diff a.safetensors b.safetensors --atol 1e-6 --json"
)
def diff(
    a: Annotated[str, typer.Argument(metavar="A", help="First checkpoint (any format).")],
    b: Annotated[str, typer.Argument(metavar="B", help="Second checkpoint (any format).")],
    atol: Annotated[
        float, typer.Option("--atol", metavar="X", help="Absolute tolerance (default: exact).")
    ] = 0.0,
    rtol: Annotated[
        float, typer.Option("--rtol", metavar="X", help="Relative tolerance (default: exact).")
    ] = 0.0,
    fmt_a: Annotated[
        str | None,
        typer.Option("--format-a", metavar="FORMAT", help="Format of A (default: detected)."),
    ] = None,
    fmt_b: Annotated[
        str | None,
        typer.Option("--format-b", metavar="FORMAT", help="Format of B (default: detected)."),
    ] = None,
    clean_fqns: CleanFqns = True,
    json_out: JsonOut = False,
    quiet: Quiet = False,
    trust_pickle: TrustPickle = False,
    device: DeviceOpt = None,
) -> int:
    """Compare two checkpoints leaf by leaf; exit 0 when equal, 1 when they differ."""
    with launch(device.value if device else None) as runtime:
        result = api.diff(
            a,
            b,
            fmt_a=fmt_a,
            fmt_b=fmt_b,
            atol=atol,
            rtol=rtol,
            clean_fqns=clean_fqns,
            trust_pickle=trust_pickle,
            runtime=runtime,
            progress=Progress(
                enabled=runtime.coordinator and not quiet and not json_out, desc="diff"
            ),
        )
    _emit(json.dumps(render.diff_json(result)) if json_out else render.diff_text(result))
    return 0 if result.equal else EXIT_DIFFERENT


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


def report(error: ShardckptError) -> None:
    """Print ``error`` once: by the rank it started on, or by rank 0 when every rank saw it."""
    # torchrun's root cause is whichever rank exited first, so every rank leaves the line.
    _record_for_torchrun(error)
    if isinstance(error, RemoteRankError):
        return
    if env_rank() != 0 and not getattr(error, "agreed", False):
        return
    print(f"shardckpt: error: {error.line()}", file=sys.stderr)


def _record_for_torchrun(error: ShardckptError) -> None:
    """Give torchrun's root-cause summary our one-line error instead of a Python stack."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    line = f"shardckpt: error: {error.line()}"
    record = {
        "message": {
            "message": line,
            "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))},
        }
    }
    # The summary is a courtesy: the error line is already on stderr, so a failed write is ignored.
    with contextlib.suppress(OSError), open(path, "w") as f:
        json.dump(record, f)


def run(argv: list[str] | None = None) -> int:
    """Run the CLI on ``argv`` and return the exit code (for tests and ``main``)."""
    try:
        code = app(args=argv, prog_name="shardckpt", standalone_mode=False)
        return code if isinstance(code, int) else 0
    except ShardckptError as exc:
        report(exc)
        return exc.exit_code
    except OSError as exc:
        failure = IOFailure(
            exc.strerror or str(exc), path=exc.filename, hint="check free space and permissions"
        )
        failure.agreed = getattr(exc, "agreed", False)
        report(failure)
        return failure.exit_code
    except typer.Exit as exc:
        return exc.exit_code
    except (typer.Abort, KeyboardInterrupt):
        return 130
    except Exception as exc:
        # Typer's usage errors (bad option, missing argument) know how to show themselves.
        if not (hasattr(exc, "show") and isinstance(getattr(exc, "exit_code", None), int)):
            raise
        if env_rank() == 0:
            exc.show()
        return exc.exit_code


def main() -> None:
    """Console-script entry point; torchrun's ``@record`` names a crashing rank's traceback."""
    from torch.distributed.elastic.multiprocessing.errors import record

    sys.exit(record(run)())
