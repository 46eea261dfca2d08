"""Write the DeepSpeed benchmark source: a ZeRO-2 bf16 checkpoint saved by DeepSpeed itself.

Run under torchrun (CPU accelerator, gloo) with deepspeed installed, e.g.:

    DS_ACCELERATOR=cpu python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        scripts/bench_make_deepspeed.py .bench/zero2-1gb --size-gb 1.0

The model is the Linear stack of ``bench_make_ckpt.py``, sized so that what a ZeRO-2
bf16 save holds per parameter (the bf16 module weight, the fp32 master and the two AdamW
moments: 14 bytes) comes to at least SIZE_GB. One step of torch's AdamW
(``"torch_adam": true``), then ``engine.save_checkpoint``: the run directory (``latest``,
``global_step1/``, the ``zero_to_fp32.py`` DeepSpeed copies beside) is written beside
OUT_DIR and renamed into place only when complete.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from bench_make_ckpt import model_shape, parse_args, save_in_place
from torch import nn

# bf16 module weight + fp32 master + exp_avg + exp_avg_sq
BYTES_PER_PARAM = 2 + 3 * 4


def main() -> None:
    """Train one step with DeepSpeed ZeRO-2 and save the run into OUT_DIR."""
    import deepspeed

    args = parse_args(__doc__.splitlines()[0])
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    width, layers = model_shape(args.size_gb, BYTES_PER_PARAM)
    if dist.get_rank() == 0:
        print(f"bench_make_deepspeed: {layers} x Linear({width}, {width}), ZeRO-2 bf16", flush=True)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2},
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    loss = engine(torch.randn(2, width, dtype=torch.bfloat16)).float().sum()
    engine.backward(loss)
    engine.step()
    save_in_place(args.out_dir, lambda tmp: engine.save_checkpoint(str(tmp)))


if __name__ == "__main__":
    main()
