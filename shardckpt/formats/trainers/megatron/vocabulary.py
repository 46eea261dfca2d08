"""What Megatron's ``.metadata`` names beyond DCP's own metadata classes.

megatron-core's ``torch_dist`` writer keeps every rank's ``SavePlan`` in the metadata it
saves (``Metadata.all_local_plans``), to reuse the plan at the next save. The plans are
DCP's own dataclasses (``SavePlan``, ``WriteItem`` with its ``WriteItemType`` and
``TensorWriteData``); they are admitted by the same exact-name unpickler that reads DCP
metadata, and nothing else is. shardckpt does not use them: which chunk each rank
wrote is in ``storage_data`` already.
"""

from __future__ import annotations

from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from shardckpt.core.torch_internals import lookup


def save_plan_vocabulary() -> dict[tuple[str, str], object]:
    """Return ``(module, name)`` -> class for what Megatron's save plans pickle."""
    classes = (SavePlan, WriteItem, WriteItemType, TensorWriteData)
    vocabulary: dict[tuple[str, str], object] = {(c.__module__, c.__qualname__): c for c in classes}
    # FileSystemWriter names a plan's files by a prefix object where it keeps one.
    prefix = lookup("torch.distributed.checkpoint.filesystem", "_StoragePrefix")
    if prefix is not None:
        vocabulary[("torch.distributed.checkpoint.filesystem", "_StoragePrefix")] = prefix
    return vocabulary
