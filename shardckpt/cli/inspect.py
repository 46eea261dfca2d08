"""``shardckpt inspect``: what a checkpoint holds, from metadata only."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from shardckpt.cli import library
from shardckpt.cli.options import Filters, JsonOut, SrcFormat, TrustPickle, Version, Wraps, emit

EPILOG = (
    "Examples (they run as written after `bash scripts/demo.sh`, on its checkpoint):\n\n"
    "  shardckpt inspect .demo/ckpt-dcp\n\n"
    "  shardckpt inspect .demo/ckpt-dcp --json --filter 'model.blocks.0.*'\n\n"
    "  shardckpt inspect .demo/ckpt-dcp --shards"
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
            help="pkg.module:factory; names what fsdp1-local flat params hold "
            "(for fsdp1-local sources only).",
        ),
    ] = None,
    wraps: Wraps = None,
    version: Version = False,
) -> int:
    """Show what a checkpoint holds, from metadata only: leaves, shapes, dtypes, layouts, optimizers."""
    library.load()
    from shardckpt import api
    from shardckpt.cli import render
    from shardckpt.core.dist import launch

    request = api.InspectRequest(
        src=src,
        format=fmt,
        filters=filters or (),
        trust_pickle=trust_pickle,
        model=model,
        wraps=wraps or (),
    )
    with launch("cpu") as runtime:
        result = api.inspect(request, runtime)
    emit(
        json.dumps(render.inspection_json(result, shards))
        if json_out
        else render.inspection_text(result, shards)
    )
    return 0
