"""megatron-core jobs: save a tiny GPTModel at TP=2 with ``dist_checkpointing``, load one at TP=1.

Run as scripts (``torchrun ... megatron_jobs.py save DIR``, ``python megatron_jobs.py load
DIR OUT``), not in the pooled harness ranks: Megatron's ``torch_dist`` writer starts a
``spawn`` multiprocessing manager, which re-imports the launching script as its main
module. megatron-core 0.16.1 runs on CPU with gloo once two CUDA calls its save and
load make unconditionally are shimmed (``torch.cuda.synchronize`` and
``current_device``, which only place a flag tensor); the shims live here, in the test
job, never in shardckpt.
"""

from __future__ import annotations

import argparse
import os
import random
import sys

import numpy as np
import torch
import torch.distributed as dist

ITERATION = 7
NUM_LAYERS = 2
HIDDEN = 16
HEADS = 4
VOCAB = 64
SEQ = 8


def _cpu_shims() -> None:
    """Let megatron-core's save and load run without CUDA (test jobs only)."""
    torch.cuda.synchronize = lambda *args, **kwargs: None
    # The one tensor made on it is a failure flag that is broadcast over gloo.
    torch.cuda.current_device = lambda: "cpu"


def _gpt(tp: int):
    """Return the tiny GPTModel of a job at tensor-parallel size ``tp`` (same weights at any tp)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    # CPU initialization draws each full weight from this generator and keeps this
    # rank's part: every tp gives the same global weights.
    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=NUM_LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        use_cpu_initialization=True,
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
    )


def _rng_state(tp_rank: int, tp: int):
    """Return Megatron training's ``rng_state`` ShardedObject: per-TP-rank RNG states (numpy's among them)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    random.seed(tp_rank)
    np.random.seed(tp_rank)
    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
    }
    return ShardedObject("rng_state", [state], (tp,), (tp_rank,), replica_id=0)


def save(ckpt: str) -> None:
    """Save the model's sharded state dict, an RNG ShardedObject and common values (2 ranks, TP=2)."""
    from megatron.core import dist_checkpointing, parallel_state

    model = _gpt(tp=2)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    state = {
        "model": model.sharded_state_dict(prefix=""),
        "rng_state": _rng_state(tp_rank, 2),
        "iteration": ITERATION,
        "checkpoint_version": 3.0,
        "args": argparse.Namespace(tensor_model_parallel_size=2, lr=1e-3, seq_length=SEQ),
        "opt_param_scheduler": {"num_steps": ITERATION * 4, "max_lr": 1e-3},
    }
    if dist.get_rank() == 0:
        os.makedirs(ckpt, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(state, ckpt)


def load(ckpt: str, out: str) -> None:
    """Load ``ckpt`` into the model at TP=1 (one rank); ``torch.save`` its state dict and ``iteration``."""
    from megatron.core import dist_checkpointing
    from megatron.core.safe_globals import register_safe_globals

    # What Megatron's training loop does before loading: common.pt holds an argparse.Namespace.
    register_safe_globals()
    model = _gpt(tp=1)
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict(prefix="")}, ckpt)
    model.load_state_dict(loaded["model"])
    weights = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    torch.save({"model": weights, "iteration": loaded["iteration"]}, out)


def main() -> None:
    """Run ``save DIR`` (under torchrun, 2 ranks) or ``load DIR OUT`` (one process)."""
    torch.set_num_threads(1)
    _cpu_shims()
    if sys.argv[1] == "load":
        # One rank, rendezvous through a file beside the output: no port to collide on.
        store = f"{sys.argv[3]}.store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    else:
        dist.init_process_group("gloo")
    try:
        if sys.argv[1] == "save":
            save(sys.argv[2])
        else:
            load(sys.argv[2], sys.argv[3])
        dist.barrier()
    finally:
        dist.destroy_process_group()
        if sys.argv[1] == "load" and os.path.exists(f"{sys.argv[3]}.store"):
            os.remove(f"{sys.argv[3]}.store")


if __name__ == "__main__":
    main()
