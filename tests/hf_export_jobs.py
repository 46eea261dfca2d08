"""Functions run on gloo ranks for the ``--hf-config`` tests: a transformers model trained
under FSDP2 and saved as a training job saves it (importable by spawned ranks); the tiny
Llama those tests export."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.fsdp import fully_shard


def tiny_llama(tied: bool = True, seed: int = 0):
    """Return a randomly initialised Llama of 2 layers and 21 tensors (tied embeddings), seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=37,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def untied_llama():
    """Return ``tiny_llama`` with its own ``lm_head`` (a ``--model`` factory)."""
    return tiny_llama(tied=False)


def load_dcp_into_fsdp2_llama(dcp_dir: str, tied: bool) -> dict | None:
    """Return, on rank 0, the full state of a Llama that FSDP2 shards and ``dcp.load``s from ``dcp_dir``.

    The model starts from other weights (seed 1), and ``dcp.load`` runs with its default
    planner, which refuses a key the checkpoint lacks: what a training job resumes with.
    """
    model = tiny_llama(tied, seed=1)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=dcp_dir)
    set_model_state_dict(model, state["model"])
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=options)
    return full if torch.distributed.get_rank() == 0 else None


def save_fsdp2_dcp(model_dir: str, dcp_dir: str) -> None:
    """Load the model saved in ``model_dir``, shard it with FSDP2, ``dcp.save({"model": ...})``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=dcp_dir)
    torch.distributed.barrier()
