"""Functions run on gloo ranks for the ``--hf-config`` tests: a transformers model trained
under FSDP2 and saved as a training job saves it (importable by spawned ranks)."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import fully_shard


def save_fsdp2_dcp(model_dir: str, dcp_dir: str) -> None:
    """Load the model saved in ``model_dir``, shard it with FSDP2, ``dcp.save({"model": ...})``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=dcp_dir)
    torch.distributed.barrier()
