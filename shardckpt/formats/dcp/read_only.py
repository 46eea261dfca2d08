"""The writer of a format shardckpt reads but does not write."""

from __future__ import annotations

from shardckpt.core.errors import UsageError
from shardckpt.formats.base import Frame, Writer


class ReadOnlyWriter(Writer):
    """Refuses, before anything is written: the format is read only."""

    def __init__(self, root, plan):
        raise UsageError(
            f"shardckpt reads {plan.format} checkpoints but does not write them",
            hint="write --format dcp for a sharded output (torch's own loaders read it), or --to full",
        )

    def frame(self, runtime) -> Frame:  # pragma: no cover - never made
        raise NotImplementedError
