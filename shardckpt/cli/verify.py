"""``shardckpt verify``: whether every byte of a checkpoint is as it was written."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from shardckpt.cli import library
from shardckpt.cli.help import examples
from shardckpt.cli.options import (
    DeviceOpt,
    JsonOut,
    Quiet,
    SrcFormat,
    StorageOptions,
    Threads,
    TrustPickle,
    Version,
    emit,
    will_emit,
)
from shardckpt.core.errors import BadInputError

EPILOG = (
    examples(
        "shardckpt verify .demo/ckpt-dcp",
        "shardckpt verify .demo/model.safetensors --json",
        "torchrun --standalone --nproc-per-node 2 -m shardckpt verify .demo/ranks-at-2 -q && echo intact",
        intro="Examples (they run as written after `bash scripts/demo.sh` and "
        "`shardckpt convert --help`'s):",
    )
    + "\n\nExit 0 when intact, 3 when anything is damaged (each damaged tensor and file is listed)."
)


def verify(
    src: Annotated[
        str,
        typer.Argument(
            metavar="SRC",
            help="Checkpoint, in any format shardckpt reads: a path or a URL (s3://bucket/prefix).",
        ),
    ],
    fmt: SrcFormat = None,
    json_out: JsonOut = False,
    quiet: Quiet = False,
    trust_pickle: TrustPickle = False,
    storage_options: StorageOptions = None,
    device: DeviceOpt = None,
    threads: Threads = None,
    version: Version = False,
) -> int:
    """Read every byte of a checkpoint once and check it against the checksums written with it."""
    library.load(tensors=False)
    from shardckpt import api
    from shardckpt.api import applies
    from shardckpt.cli import render
    from shardckpt.core.dist import launch
    from shardckpt.core.progress import Progress

    applies.check(applies.VERIFY_RULES, applies.Choice(quiet=quiet, json_out=json_out))
    request = api.VerifyRequest(
        src=src,
        format=fmt,
        trust_pickle=trust_pickle,
        storage_options=storage_options or (),
        threads=threads,
    )
    with launch(device.value if device else None) as runtime:
        if not quiet:
            runtime.check(will_emit)
        bar = runtime.coordinator and not quiet and not json_out
        result = api.verify(request, runtime, Progress(enabled=bar, desc="verify"))
    if not quiet:
        emit(json.dumps(render.verify_json(result)) if json_out else render.verify_text(result))
    raise_if_damaged(result, listed=not quiet)
    return 0


def raise_if_damaged(result, listed: bool) -> None:
    """Raise the one-line error (exit 3) naming the first finding of ``verify``, if any; ``listed``: all are on stdout."""
    if result.intact:
        return
    first, more = result.damaged[0], len(result.damaged) - 1
    where = "listed on stdout" if listed else "run without -q to list them"
    raise BadInputError(
        first.message + (f" ({more} more damaged, {where})" if more else ""),
        path=first.file,
        hint="the file was damaged after it was written; re-copy it",
    )
