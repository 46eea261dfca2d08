"""A 1.1 GB ZeRO-2 save for docs/benchmark.md's DeepSpeed row (run under torchrun, 2 ranks, CPU).

    DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node 2 scripts/bench_deepspeed_job.py RUN_DIR

Twenty 2048x2048 Linears (84M parameters) in bf16 with torch's AdamW, one step, then
``engine.save_checkpoint(RUN_DIR)``: two 0.5 GB optimizer files and a 0.17 GB module.
"""

from __future__ import annotations

import os
import sys

import deepspeed
import deepspeed.ops
import torch

# No compiler run for DeepSpeed's shared-memory collective: gloo alone does.
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
torch.set_num_threads(1)
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(20)])
config = {
    "train_micro_batch_size_per_gpu": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    "zero_optimization": {"stage": 2},
    "bf16": {"enabled": True},
}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
x = torch.randn(1, 2048, dtype=torch.bfloat16)
engine.backward(engine(x).float().pow(2).mean())
engine.step()
engine.save_checkpoint(sys.argv[1])
os._exit(0)  # DeepSpeed's threads may abort the interpreter's teardown
