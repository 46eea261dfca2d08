"""Rank functions for the optimizer-key acceptance tests: real DDP and FSDP1 on gloo ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
from reference import example
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict


class CompiledLike(nn.Module):
    """Holds the model as ``_orig_mod``, the attribute ``torch.compile``'s wrapper uses.

    Compiling on two shared cores would cost minutes; the checkpoint keys
    (``module._orig_mod.…`` under DDP) are what matters here.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self._orig_mod = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Return the wrapped model's output."""
        return self._orig_mod(tokens)


def ddp_checkpoint(path: str) -> dict | None:
    """Train the example with DDP, ``torch.save`` its plain state on rank 0; return the truth.

    The truth is ``get_state_dict`` of the unwrapped model: clean FQNs, FQN-keyed state.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = example.build_model(0)
    wrapped = DDP(CompiledLike(model))
    optimizer = example.build_optimizer(wrapped)
    example.train(wrapped, optimizer, steps=2, seed=0)
    if dist.get_rank() != 0:
        return None
    torch.save({"model": wrapped.state_dict(), "optim": optimizer.state_dict()}, path)
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd}


def fsdp1_rekey(use_orig_params: bool) -> dict:
    """Train the example under FSDP1; return its full FQN-keyed state and torch's rekeyings."""
    from torch.distributed.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        OptimStateKeyType,
        StateDictType,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    wrapped = FSDP(
        example.build_model(0),
        auto_wrap_policy=ModuleWrapPolicy({example.Block}),
        use_orig_params=use_orig_params,
        device_id=torch.device("cpu"),
    )
    # Without use_orig_params the optimizer sees flat parameters: one group is all it can have.
    optimizer = (
        example.build_optimizer(wrapped)
        if use_orig_params
        else torch.optim.AdamW(wrapped.parameters())
    )
    example.train(wrapped, optimizer, steps=2, seed=0)
    FSDP.set_state_dict_type(
        wrapped,
        StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(rank0_only=False),
        FullOptimStateDictConfig(rank0_only=False),
    )
    full = FSDP.optim_state_dict(wrapped, optimizer)
    plain = example.build_model(0)
    plain_optimizer = (
        example.build_optimizer(plain) if use_orig_params else torch.optim.AdamW(plain.parameters())
    )
    by_id = FSDP.rekey_optim_state_dict(
        full, OptimStateKeyType.PARAM_ID, plain, optim=plain_optimizer
    )
    by_name = FSDP.rekey_optim_state_dict(
        by_id, OptimStateKeyType.PARAM_NAME, plain, optim=plain_optimizer
    )
    return {"full": full, "by_id": by_id, "by_name": by_name}


def named_groups(model: nn.Module, prefix: str = "") -> list[dict]:
    """Return ``example.param_groups`` built from ``named_parameters()``, listed against model order.

    Same membership and hyper-parameters, but the vectors' group first and each group
    backwards: no order of the model's tensors fits, so only the stored names tell IDs.
    """
    groups = example.param_groups(model)
    names = {id(p): prefix + n for n, p in model.named_parameters()}
    return [
        {**g, "params": [(names[id(p)], p) for p in reversed(g["params"])]}
        for g in reversed(groups)
    ]


def ddp_named_checkpoint(path: str) -> dict | None:
    """Train the example under DDP with an optimizer built from the wrapper's names; save on rank 0.

    The names are DDP's (``module.…``), as ``named_parameters()`` of the wrapped model
    gives them. The truth is ``get_state_dict`` of the unwrapped model, with the names
    an FSDP2 job gives the same parameters.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = example.build_model(0)
    wrapped = DDP(model)
    optimizer = torch.optim.AdamW(named_groups(model, "module."), betas=(0.9, 0.95))
    example.train(wrapped, optimizer, steps=2, seed=0)
    if dist.get_rank() != 0:
        return None
    torch.save({"model": wrapped.state_dict(), "optim": optimizer.state_dict()}, path)
    msd, osd = get_state_dict(model, optimizer)
    for group in osd["param_groups"]:
        group["param_names"] = [n.removeprefix("module.") for n in group["param_names"]]
    return {"model": msd, "optim": osd}


def named_optimizer(model: nn.Module) -> torch.optim.AdamW:
    """Return the AdamW an FSDP2 job builds from ``named_groups`` (its names have no prefix)."""
    return torch.optim.AdamW(named_groups(model), betas=(0.9, 0.95))
