"""torch's other DCP writers, run on gloo ranks (importable by spawned ranks): an FSDP2 model
and its AdamW saved as HF-storage shards and as safetensors-serialized DCP."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter, HuggingFaceStorageWriter
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch_checkpointing_jobs import trained

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def save(root: str) -> dict | None:
    """Save ``root/hf`` (HuggingFaceStorageWriter, model) and ``root/st`` (safetensors DCP, model
    and optimizer); return on rank 0 the full state the ranks held."""
    model, optim = trained()
    msd = get_model_state_dict(model)
    writer = HuggingFaceStorageWriter(
        str(Path(root) / "hf"), save_distributed=True, enable_consolidation=False
    )
    dcp.save(msd, storage_writer=writer)
    st = FileSystemWriter(Path(root) / "st", serialization_format=SerializationFormat.SAFETENSORS)
    dcp.save({"model": msd, "optim": get_optimizer_state_dict(model, optim)}, storage_writer=st)
    full = {
        "model": get_model_state_dict(model, options=FULL),
        "optim": get_optimizer_state_dict(model, optim, options=FULL),
    }
    return full if dist.get_rank() == 0 else None
