"""What a Megatron chunk is: one layer of a stack, a tensor-parallel piece, or both.

megatron-core saves the layers of a ``TransformerBlock`` as one tensor per parameter
name, stacked on a leading axis (``decoder.layers.mlp.linear_fc1.weight`` of shape
``(num_layers, ...)``): each layer is a chunk of size 1 on that axis, whichever rank
wrote it. A tensor-parallel split cuts the other dimensions among ranks. Read as FSDP's
row split, a replicated layer norm of two layers would look like "Shard(0) over 2";
here it is "2 stacked layers".
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from shardckpt.core.words import counted
from shardckpt.state.tree import Chunk

# A stacked key names the block's layers without a layer number: "decoder.layers.mlp...".
_STACKED = re.compile(r"(?:^|\.)layers\.(?!\d)")


def describe(key: str, shape: tuple[int, ...], chunks: Sequence[Chunk]) -> str | None:
    """Return how Megatron split ``key`` into ``chunks``, or None when they form no regular grid."""
    real = [c for c in chunks if 0 not in c.sizes]
    if not shape or not real:
        return "full" if real else None
    stacked = bool(_STACKED.search(key)) and all(c.sizes[0] == 1 for c in real)
    first = 1 if stacked else 0
    pieces = [len({c.offsets[d] for c in real}) for d in range(len(shape))]
    if math.prod(pieces) != len(real):
        return None  # not a grid: DCP's own description says more
    splits = [f"{pieces[d]} on dim {d}" for d in range(first, len(shape)) if pieces[d] > 1]
    split = f"split in {', '.join(splits)}" if splits else ""
    if not stacked:
        return split or "full"
    layers = counted(shape[0], "stacked layer")
    return f"{layers}, each {split}" if split else layers
