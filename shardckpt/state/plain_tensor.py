"""A tensor as a ``torch.save`` pickle describes it, for the commands that read metadata without torch.

``inspect`` and ``verify`` of a ``torch.save`` file need each tensor's dtype and shape
and which zip record holds its bytes, not the bytes: ``codecs.torch_pickle`` builds a
``PlainTensor`` where ``torch.load`` would build a tensor. It holds no data and does no
arithmetic; ``state.tree`` takes it for a tensor leaf as it takes torch's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardckpt.state.dtypes import Dtype


@dataclass(eq=False)
class PlainTensor:
    """A tensor's view of a storage record: its dtype, shape, stride and first element there."""

    dtype: Dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    storage: str
    """The key of its storage's record (``archive/data/KEY``)."""
    storage_bytes: int
    """The bytes of that record."""

    def numel(self) -> int:
        """Return the number of elements, as torch's ``numel()`` does."""
        return math.prod(self.shape)

    def is_contiguous(self) -> bool:
        """Return whether its elements lie in order, one after another, as torch's ``is_contiguous()`` says."""
        if not all(self.shape):
            return True
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True
