"""``shardckpt diff``: leaf-by-leaf comparison of two checkpoints."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from shardckpt.cli import library
from shardckpt.cli.help import examples
from shardckpt.cli.options import (
    BufferSize,
    CleanFqns,
    DeviceOpt,
    Filters,
    JsonOut,
    StorageOptions,
    TrustPickle,
    Version,
    emit,
    emit_notes,
    only_option,
    parse_size,
    source_format_option,
    will_emit,
)
from shardckpt.core.errors import EXIT_DIFFERENT

EPILOG = examples(
    "shardckpt diff .demo/ckpt-dcp .demo/export.pt",
    "shardckpt diff .demo/ckpt-dcp .demo/ckpt-at-8 --filter 'optim.*' --json",
    "shardckpt diff .demo/ckpt-dcp .demo/model.safetensors --only model --atol 1e-6",
    "shardckpt diff .demo/export.pt .demo/hf-model --only model --cast --atol 1e-2",
    "shardckpt diff .demo/export.pt .demo/ranks-at-2 -q && echo same",
    "shardckpt diff .demo/ckpt-dcp .demo/ckpt-at-8 --buffer-size 64MiB -q",
    intro="Examples (they run as written after `bash scripts/demo.sh` and `shardckpt "
    "convert --help`'s):",
)


def diff(
    a: Annotated[
        str, typer.Argument(metavar="A", help="First checkpoint (any format; a path or a URL).")
    ],
    b: Annotated[
        str, typer.Argument(metavar="B", help="Second checkpoint (any format; a path or a URL).")
    ],
    atol: Annotated[
        float,
        typer.Option(
            "--atol", metavar="X", show_default=False, help="Absolute tolerance (default: exact)."
        ),
    ] = 0.0,
    rtol: Annotated[
        float,
        typer.Option(
            "--rtol", metavar="X", show_default=False, help="Relative tolerance (default: exact)."
        ),
    ] = 0.0,
    fmt_a: Annotated[
        str | None, source_format_option("--from-a", "Format of A (default: detected).")
    ] = None,
    fmt_b: Annotated[
        str | None, source_format_option("--from-b", "Format of B (default: detected).")
    ] = None,
    only: only_option(
        "Compare all, model (all but optimizers; against a model-only export) or optim."
    ) = "all",
    filters: Filters = None,
    cast: Annotated[
        bool,
        typer.Option(
            "--cast",
            help="Compare floating tensors of different dtypes in the wider one (fp32 vs its "
            "bf16 export: --cast --atol 1e-2); each dtype change is reported once.",
        ),
    ] = False,
    unnest_a: Annotated[
        str | None,
        typer.Option(
            "--unnest-a",
            metavar="KEY",
            help="Compare A's subtree at top-level KEY as its root (as convert --unnest).",
        ),
    ] = None,
    nest_a: Annotated[
        str | None,
        typer.Option(
            "--nest-a",
            metavar="KEY",
            help="Compare A as if under top-level KEY (as convert --nest): a flat state_dict "
            "against a {'model': ...} checkpoint.",
        ),
    ] = None,
    unnest_b: Annotated[
        str | None,
        typer.Option("--unnest-b", metavar="KEY", help="As --unnest-a, for B."),
    ] = None,
    nest_b: Annotated[
        str | None, typer.Option("--nest-b", metavar="KEY", help="As --nest-a, for B.")
    ] = None,
    clean_fqns: CleanFqns = True,
    buffer_size: BufferSize = "256MiB",
    json_out: JsonOut = False,
    quiet: Annotated[
        bool,
        typer.Option(
            "--quiet", "-q", help="Print nothing: the exit code says equal (0) or different (1)."
        ),
    ] = False,
    trust_pickle: TrustPickle = False,
    storage_options: StorageOptions = None,
    device: DeviceOpt = None,
    version: Version = False,
) -> int:
    """Compare two checkpoints leaf by leaf; exit 0 when equal, 1 when they differ."""
    library.load(tensors=False)
    from shardckpt import api
    from shardckpt.api import applies
    from shardckpt.cli import render
    from shardckpt.core.dist import launch
    from shardckpt.core.progress import Progress

    applies.check(applies.DIFF_RULES, applies.Choice(quiet=quiet, json_out=json_out))
    with launch(device) as runtime:
        if not quiet:
            runtime.check(will_emit)
        request = api.DiffRequest(
            a=a,
            b=b,
            format_a=fmt_a,
            format_b=fmt_b,
            atol=atol,
            rtol=rtol,
            clean_fqns=clean_fqns,
            only=only,
            filters=filters or (),
            cast=cast,
            unnest_a=unnest_a,
            nest_a=nest_a,
            unnest_b=unnest_b,
            nest_b=nest_b,
            trust_pickle=trust_pickle,
            buffer_bytes=parse_size(buffer_size, "--buffer-size"),
            storage_options=storage_options or (),
        )
        progress = Progress(enabled=runtime.coordinator and not quiet and not json_out, desc="diff")
        result = api.diff(request, runtime, progress)
    if not quiet:
        emit(json.dumps(render.diff_json(result)) if json_out else render.diff_text(result))
        emit_notes(result.notes)
    return 0 if result.equal else EXIT_DIFFERENT
