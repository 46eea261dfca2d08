"""Functions run on gloo ranks for the DeepSpeed tests: an FSDP2 job of the goldens' model
resuming from what shardckpt wrote (importable by spawned ranks)."""

from __future__ import annotations

import deepspeed_model
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def fsdp2_job() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Return the model under FSDP2 on the world group (from another seed than DeepSpeed's) and
    torch's AdamW over the same two param groups DeepSpeed trained."""
    model = deepspeed_model.build(seed=1)
    fully_shard(model.fc1)
    fully_shard(model)
    groups = deepspeed_model.param_groups(model)
    return model, torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)


def _copied(tree):
    """Return ``tree`` with every tensor cloned."""
    if isinstance(tree, dict):
        return {k: _copied(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_copied(v) for v in tree)
    return tree.clone() if isinstance(tree, torch.Tensor) else tree


def resume(src: str, local: bool = False) -> dict | None:
    """Load ``src`` into the goldens' model under FSDP2 as a job resumes; train one step.

    ``src`` is a DCP directory, or with ``local`` one of ``fsdp2-ranks``. Returns what
    ``_load_and_step`` returns.
    """
    model, optim = fsdp2_job()

    def loss_of() -> torch.Tensor:
        gen = torch.Generator().manual_seed(200 + dist.get_rank())
        return deepspeed_model.loss_of(model, deepspeed_model.batch(gen))

    return _load_and_step(model, optim, src, local, loss_of)


def train_and_save(src: str, dst: str) -> dict | None:
    """Resume ``src`` under FSDP2 as ``resume`` does, train one step, and save the job with DCP.

    What an FSDP2 job writes itself (``dcp.save`` of ``get_state_dict``: its model, and its
    optimizer keyed by FQN) at ``dst``. Returns on rank 0 the full model and optimizer state
    the job saved.
    """
    model, optim = fsdp2_job()
    gen = torch.Generator().manual_seed(200 + dist.get_rank())
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=src)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    deepspeed_model.loss_of(model, deepspeed_model.batch(gen)).backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=dst)
    saved_model, saved_optim = _copied(get_state_dict(model, optim, options=FULL))
    return {"model": saved_model, "optim": saved_optim} if dist.get_rank() == 0 else None


def llama_job(config_dir: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Return the HF Trainer goldens' Llama under FSDP2 (each decoder layer, then the root) and
    torch's AdamW over its parameters as one group, as the Trainer's DeepSpeed run had them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(config_dir), dtype=torch.float32
    )
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def resume_llama(dcp_dir: str, config_dir: str) -> dict | None:
    """Load ``dcp_dir`` into the Llama under FSDP2 as ``resume`` does; train one step."""
    model, optim = llama_job(config_dir)

    def loss_of() -> torch.Tensor:
        # The Trainer's linear schedule ended at the saved step (lr 0): the job goes on with its own.
        for group in optim.param_groups:
            group["lr"] = 1e-3
        ids = torch.randint(37, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
        return model(input_ids=ids, labels=ids).loss

    return _load_and_step(model, optim, dcp_dir, False, loss_of)


def _load_and_step(model, optim, src: str, local: bool, loss_of) -> dict | None:
    """Load ``src`` into ``model`` and ``optim`` (``set_state_dict``), take a step on ``loss_of()``.

    ``src`` is a DCP directory (``dcp.load`` into this job's state dicts), or with
    ``local`` one of ``fsdp2-ranks`` (this rank's ``rank_{r}.pt``, ``torch.load``).
    Returns on rank 0 the full model and optimizer state as loaded, the model after the
    step and the step's loss.
    """
    if local:
        state = torch.load(f"{src}/rank_{dist.get_rank()}.pt", weights_only=True)
    else:
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=src)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    # Copies: a full state dict shares the tensors that need no gather (step) with the
    # optimizer, which the step below changes in place.
    loaded_model, loaded_optim = _copied(get_state_dict(model, optim, options=FULL))
    loss = loss_of()
    loss.backward()
    optim.step()
    after, _ = get_state_dict(model, optim, options=FULL)
    if dist.get_rank() != 0:
        return None
    return {"model": loaded_model, "optim": loaded_optim, "after": after, "loss": loss.item()}
