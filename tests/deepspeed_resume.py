"""A DeepSpeed job that resumes a ZeRO checkpoint with DeepSpeed's own ``load_checkpoint`` (under torchrun).

    DS_ACCELERATOR=cpu torchrun --nproc-per-node N tests/deepspeed_resume.py --train CASE ROOT
    DS_ACCELERATOR=cpu torchrun --nproc-per-node M tests/deepspeed_resume.py CASE RUN_DIR OUT [RESAVE] [--no-scheduler]

``--trainer CASE CHECKPOINT OUT`` resumes an HF Trainer case of ``make.py`` from
``CHECKPOINT`` (``Trainer.train(resume_from_checkpoint=...)``) for one more step; rank 0
saves the Trainer's step and the loss it logged into ``OUT``.

``--train`` is the goldens' job (``make.py``): 3 steps, saved into ``ROOT/CASE``, what
the job held gathered into ``ROOT/CASE.ref/gathered.pt``.

``CASE`` is a case of ``tests/goldens/deepspeed/make.py`` (its ZeRO stage, dtype and
config), or ``CASE:STAGE`` for that case's job run at another ZeRO stage; with
``--no-scheduler`` the scheduler's state is not loaded (a save from a source without one),
with ``--no-optimizer`` the optimizer's neither (``load_optimizer_states=False``). The job builds ``deepspeed_model.TinyLM`` as the goldens' job does, loads
``RUN_DIR`` with ``load_optimizer_states=True, load_lr_scheduler_states=True``, and rank
0 saves into ``OUT`` (a ``torch.save`` file) what DeepSpeed then holds: each trainable
parameter's fp32 master (``safe_get_full_fp32_param``), ``global_steps``, the scheduler's
state, the loss of one batch every rank is given alike, and the fp32 masters after one
step on it. With ``RESAVE`` the loaded state is saved again there by
``engine.save_checkpoint`` (before the step): DeepSpeed's own files of that state at M.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _make():
    spec = importlib.util.spec_from_file_location(
        "deepspeed_make", HERE / "goldens/deepspeed/make.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def no_shm_op() -> None:
    """Keep DeepSpeed from compiling its shared-memory collective (minutes on first launch): gloo alone does."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def resume(
    case: str,
    run_dir: Path,
    out: Path,
    resave: Path | None,
    scheduler: bool = True,
    optimizer: bool = True,
) -> None:
    """Load ``run_dir`` at this launch's world size; rank 0 writes what the job holds into ``out``."""
    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_fp32_param

    sys.path.insert(0, str(HERE))
    import deepspeed_model

    torch.set_num_threads(1)
    make = _make()
    case, _, other = case.partition(":")
    stage, dtype, _, zero, extra = make.CASES[case]
    stage = int(other) if other else stage
    no_shm_op()
    deepspeed.init_distributed(dist_backend="gloo")
    model = deepspeed_model.build(seed=1)  # other weights than the run's: the load must set them
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=deepspeed_model.param_groups(model),
        config=make.config(stage, dtype, zero, extra),
    )
    path, client = engine.load_checkpoint(
        str(run_dir), load_optimizer_states=optimizer, load_lr_scheduler_states=scheduler
    )
    assert path is not None, f"load_checkpoint found nothing in {run_dir}"
    if resave is not None:
        engine.save_checkpoint(
            str(resave), client_state={k: client[k] for k in ("epoch", "note") if k in client}
        )
    fp32 = {
        fqn: safe_get_full_fp32_param(p).detach().cpu().clone()
        for fqn, p in engine.module.named_parameters()
        if p.requires_grad
    }
    held = {
        "fp32": fp32,
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "lr_scheduler": engine.lr_scheduler.state_dict(),
        "client": {k: client[k] for k in ("epoch", "note") if k in client},
        "world_size": torch.distributed.get_world_size(),
    }
    tokens = deepspeed_model.batch(torch.Generator().manual_seed(7))  # alike on every rank
    loss = deepspeed_model.loss_of(engine, tokens)
    engine.backward(loss)
    engine.step()
    held["loss"] = float(loss.detach())
    held["stepped"] = {
        fqn: safe_get_full_fp32_param(p).detach().cpu().clone()
        for fqn, p in engine.module.named_parameters()
        if p.requires_grad
    }
    held["global_steps_after"] = engine.global_steps
    if torch.distributed.get_rank() == 0:
        torch.save(held, out)
    torch.distributed.barrier()


def trainer_resume(name: str, checkpoint: Path, out: Path) -> None:
    """Resume the Trainer case ``name`` from ``checkpoint`` for one step; rank 0 saves what it did."""
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    no_shm_op()
    torch.set_num_threads(1)
    make = _make()
    torch.manual_seed(1)  # other weights than the run's: the resume must set them
    model = LlamaForCausalLM(LlamaConfig(**make.LLAMA))
    ds_config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True},
        },
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": make.TRAINER_CASES[name]},
    }
    args = TrainingArguments(
        output_dir=str(out.parent / "trainer-out"),
        per_device_train_batch_size=2,
        max_steps=make.STEPS + 1,
        save_strategy="no",
        learning_rate=1e-2,
        weight_decay=0.1,
        bf16=True,
        use_cpu=True,
        deepspeed=ds_config,
        report_to=[],
        logging_steps=1,
    )
    trainer = Trainer(model=model, args=args, train_dataset=make.Tokens())
    trainer.train(resume_from_checkpoint=str(checkpoint))
    if dist.get_rank() == 0:
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        torch.save(
            {
                "global_step": trainer.state.global_step,
                "losses": losses,
                "world_size": dist.get_world_size(),
                "engine_steps": trainer.model_wrapped.global_steps,
            },
            out,
        )
    dist.barrier()


if __name__ == "__main__":
    import os

    args = [a for a in sys.argv[1:] if a not in ("--no-scheduler", "--no-optimizer")]
    if args[0] == "--train":
        no_shm_op()
        _make().job(args[1], Path(args[2]))
    elif args[0] == "--trainer":
        trainer_resume(args[1], Path(args[2]), Path(args[3]))
    else:
        resave = Path(args[3]) if len(args) > 3 else None
        scheduler, optimizer = ("--no-scheduler" not in sys.argv, "--no-optimizer" not in sys.argv)
        resume(args[0], Path(args[1]), Path(args[2]), resave, scheduler, optimizer)
    # DeepSpeed's threads abort the interpreter's teardown now and then ("terminate called
    # without an active exception"): the job's work is done and written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
