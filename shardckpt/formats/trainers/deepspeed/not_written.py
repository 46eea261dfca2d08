"""DeepSpeed checkpoints are a source only: the writer a ``deepspeed`` output would get refuses."""

from __future__ import annotations

from shardckpt.core.errors import UsageError
from shardckpt.formats.base import Frame, Writer


class NotWritten(Writer):
    """Refuses, before any file is written: shardckpt reads DeepSpeed checkpoints and does not write them."""

    def __init__(self, root, plan):
        raise UsageError(
            "shardckpt reads DeepSpeed checkpoints but does not write them",
            hint="write --to sharded --format dcp (FSDP2 at M; or accelerate, torchtitan), "
            "--to full (torch, safetensors, hf), or --to local (fsdp2-ranks)",
        )

    def frame(self, runtime) -> Frame:
        """Never called: ``__init__`` refuses."""
        raise NotImplementedError
