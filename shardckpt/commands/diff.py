"""``shardckpt diff``: leaf-by-leaf comparison of two checkpoints."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from shardckpt import api, render
from shardckpt.dist import launch
from shardckpt.errors import EXIT_DIFFERENT
from shardckpt.options import CleanFqns, DeviceOpt, JsonOut, Quiet, TrustPickle, Version, emit
from shardckpt.progress import Progress

EPILOG = "Examples:\n\n  shardckpt diff ckpt/step-100 full.pt\n\n  shardckpt diff a.safetensors b.safetensors --atol 1e-6 --json"


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
    version: Version = False,
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
    emit(json.dumps(render.diff_json(result)) if json_out else render.diff_text(result))
    return 0 if result.equal else EXIT_DIFFERENT
