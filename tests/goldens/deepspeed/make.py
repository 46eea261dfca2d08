"""Write the DeepSpeed goldens: real ZeRO checkpoints and what DeepSpeed itself reads from them.

    DS_ACCELERATOR=cpu python tests/goldens/deepspeed/make.py [NAME ...]

needs deepspeed (0.19.8 was used; see README.md), huggingface_hub (which the
``zero_to_fp32.py`` script DeepSpeed copies into each run imports), and for the HF
Trainer cases transformers and accelerate (5.23.0 and 1.15.0). For each case of
``CASES`` it runs a 3-step training job of ``tests/deepspeed_model.TinyLM`` under torchrun (gloo,
CPU accelerator, torch's AdamW through ``"torch_adam": true``, a WarmupLR scheduler and
a client state), saved with ``engine.save_checkpoint(NAME)``, then writes ``NAME.ref/``:

- ``zero_to_fp32.bin``: the output of the ``zero_to_fp32.py`` DeepSpeed copied into the
  run, run as a script on the run (``pytorch_model.bin``), where the script supports the
  run (``zero_to_fp32.txt`` says why where it does not);
- ``gathered.pt``: what the job held when it saved, gathered by DeepSpeed's own API on
  every rank: each trainable parameter's fp32 master (``safe_get_full_fp32_param``), the
  module's 16-bit (or fp32) weights and buffers, each param group's hyper-parameters and
  the names of its parameters, the optimizer's step. (The Adam moments are not gathered
  in the job: ``safe_get_full_optimizer_state`` raises "exp_avg not found in optimizer
  state fragment" for the second param group on CPU in 0.19.8.)

and runs DeepSpeed's ``ds_to_universal`` on the run into ``NAME-universal/``: its
per-parameter files (``zero/<fqn>/fp32.pt``, ``exp_avg.pt``, ``exp_avg_sq.pt``) are the
reference for the optimizer moments, and the directory is itself a source the tests
read (``universal.txt`` says why where ``ds_to_universal`` refused the run).

Each case of ``TRAINER_CASES`` fine-tunes a tiny Llama (tied embeddings) with the HF
Trainer and DeepSpeed for 3 steps at 2 ranks; ``NAME/`` is its ``checkpoint-3/`` (the
Trainer's files beside DeepSpeed's run), with ``zero_to_fp32.bin`` and ``NAME-universal/``
as above (no gather: the Trainer owns the engine).

The recovery scripts DeepSpeed copies into every run directory (``zero_to_fp32.py``,
``zero_to_torch.py``) are removed from the goldens: they are code, not checkpoint, and
each is 40 KB.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent.parent
STEPS = 3
CLIENT_STATE = {"epoch": 1, "note": "tiny"}

# name: (zero stage, dtype, ranks, extra zero_optimization settings, extra config)
CASES: dict[str, tuple[int, str, int, dict, dict]] = {
    "z1-bf16": (1, "bf16", 2, {}, {}),
    "z1-fp32": (1, "fp32", 2, {}, {}),
    "z2-bf16": (2, "bf16", 2, {}, {}),
    "z2-fp32": (2, "fp32", 2, {}, {}),
    "z3-bf16": (3, "bf16", 2, {}, {}),
    "z3-fp32": (3, "fp32", 2, {}, {}),
    "z2-fp16": (2, "fp16", 2, {}, {}),
    # Three ranks, parameters reordered round-robin for the gradient reduction.
    "z2-bf16-rr3": (2, "bf16", 3, {"round_robin_gradients": True}, {}),
    # Three ranks, each param group cut into sub-groups of at most 20 elements per rank.
    "z3-fp32-sub3": (3, "fp32", 3, {"sub_group_size": 20}, {}),
    # bf16 with fp32 gradient accumulation at stage 1 runs DeepSpeed's BF16_Optimizer.
    "z1-bf16-fp32acc": (1, "bf16", 2, {}, {"data_types": {"grad_accum_dtype": "fp32"}}),
}
# The HF Trainer fine-tuning a tiny Llama (tied embeddings) at 2 ranks: name -> ZeRO stage.
TRAINER_CASES = {"hf-z2-bf16": 2, "hf-z3-bf16": 3}
LLAMA = dict(
    vocab_size=37,
    hidden_size=12,
    intermediate_size=20,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=16,
    tie_word_embeddings=True,
)
NO_UNIVERSAL = {
    # DeepSpeed 0.19.8 records param_slice_mappings (and links its own fp32 fragments) in
    # the group's original order, while the flat group holds the round-robin order that
    # param_shapes lists: ds_to_universal (and safe_get_full_fp32_param) then give some
    # parameters another's values. zero_to_fp32.py and the module's weights agree with
    # param_shapes.
    "z2-bf16-rr3": "not run: ds_to_universal places parameters by param_slice_mappings, "
    "which DeepSpeed 0.19.8 writes in the original order under round_robin_gradients\n",
}


def config(stage: int, dtype: str, zero: dict, extra: dict) -> dict:
    """Return the DeepSpeed config of one case."""
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-2, "weight_decay": 0.1, "torch_adam": True},
        },
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
        "zero_optimization": {"stage": stage, **zero},
        **extra,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


# ---------------------------------------------------------------- the job (under torchrun)


def job(name: str, root: Path) -> None:
    """Train, save the run into ``root/NAME``, and write what DeepSpeed gathers (rank 0) into ``root/NAME.ref``."""
    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_fp32_param

    sys.path.insert(0, str(TESTS))
    import deepspeed_model

    torch.set_num_threads(1)
    stage, dtype, _, zero, extra = CASES[name]
    deepspeed.init_distributed(dist_backend="gloo")
    model = deepspeed_model.build()
    groups = deepspeed_model.param_groups(model)
    names = {id(p): n for n, p in model.named_parameters()}
    group_fqns = [[names[id(p)] for p in g["params"]] for g in groups]
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=groups, config=config(stage, dtype, zero, extra)
    )
    rank = torch.distributed.get_rank()
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        engine.backward(deepspeed_model.loss_of(engine, deepspeed_model.batch(gen)))
        engine.step()
    engine.save_checkpoint(str(root / name), client_state=dict(CLIENT_STATE))

    # Every gather below is a collective: all ranks call it, rank 0 keeps the result.
    gathered: dict = {"fp32": {}}
    for fqn, param in engine.module.named_parameters():
        if not param.requires_grad:
            continue
        gathered["fp32"][fqn] = safe_get_full_fp32_param(param).detach().cpu().clone()
    if stage == 3:
        module = engine._zero3_consolidated_16bit_state_dict()
    else:
        module = engine.module.state_dict()
    if rank != 0:
        return
    inner = engine.optimizer.optimizer
    steps = {float(s["step"]) for s in inner.state.values() if "step" in s}
    gathered["module"] = {k: v.detach().cpu().clone() for k, v in module.items()}
    gathered["step"] = steps.pop() if len(steps) == 1 else sorted(steps)
    gathered["param_groups"] = [
        {k: v for k, v in g.items() if k != "params"} for g in inner.param_groups
    ]
    gathered["group_fqns"] = group_fqns
    gathered["optimizer"] = type(engine.optimizer).__name__
    ref = root / f"{name}.ref"
    ref.mkdir(exist_ok=True)
    torch.save(gathered, ref / "gathered.pt")


def trainer_job(name: str, root: Path) -> None:
    """Fine-tune a tiny Llama with the HF Trainer and DeepSpeed; keep its last ``checkpoint-N/`` as ``root/NAME``.

    The checkpoint holds, besides DeepSpeed's run directory (``latest``, ``global_stepN/``),
    what the Trainer saves: the model's own weights and config, its state, RNG states.
    """
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    torch.set_num_threads(1)
    stage = TRAINER_CASES[name]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    ds_config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True},
        },
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": stage},
    }
    out = root / f"{name}.out"
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=2,
        max_steps=STEPS,
        save_steps=STEPS,
        learning_rate=1e-2,
        weight_decay=0.1,
        bf16=True,
        use_cpu=True,
        deepspeed=ds_config,
        report_to=[],
    )
    Trainer(model=model, args=args, train_dataset=Tokens()).train()
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root / name, ignore_errors=True)
        os.replace(out / f"checkpoint-{STEPS}", root / name)
        shutil.rmtree(out)


class Tokens:
    """16 sequences of 8 token ids, each its own labels."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict:
        import torch

        ids = torch.randint(LLAMA["vocab_size"], (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


# ---------------------------------------------------------------- the driver


def run(argv: list[str], why: Path | None = None, root: Path = HERE) -> bool:
    """Run ``argv`` with the CPU accelerator; return whether it succeeded.

    A failure raises, unless ``why`` names a file to write the failure's last line into.
    """
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(argv, env=env, capture_output=True, text=True)
    if proc.returncode == 0:
        return True
    if why is None:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"failed: {' '.join(map(str, argv))}")
    last = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
    why.write_text(f"failed on this run: {last.replace(str(root) + '/', '')}\n")
    return False


def zero_to_fp32(name: str, root: Path) -> None:
    """Run the run's own ``zero_to_fp32.py`` on it; keep its output, or why it refused."""
    run_dir, ref = root / name, root / f"{name}.ref"
    ref.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as out:
        argv = [sys.executable, str(run_dir / "zero_to_fp32.py"), str(run_dir), out]
        if run(argv, why=ref / "zero_to_fp32.txt", root=root):
            shutil.copy(Path(out) / "pytorch_model.bin", ref / "zero_to_fp32.bin")


def universal(name: str, root: Path) -> None:
    """Run ``ds_to_universal`` on the run's tag directory into ``NAME-universal/``."""
    tag = (root / name / "latest").read_text().strip()
    out = root / f"{name}-universal"
    shutil.rmtree(out, ignore_errors=True)
    if not run(
        [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            str(root / name / tag),
            "--output_folder",
            str(out / tag),
            "--num_extract_workers",
            "1",
            "--num_merge_workers",
            "1",
            # Stage 1/2 runs outside Megatron-DeepSpeed have no universal_checkpoint_info.
            "--inject_missing_state",
        ],
        why=root / f"{name}.ref" / "universal.txt",
        root=root,
    ):
        shutil.rmtree(out, ignore_errors=True)


def make(name: str, root: Path = HERE) -> None:
    """Write one case into ``root``: the run, its references, its universal form."""
    for path in (root / name, root / f"{name}.ref", root / f"{name}-universal"):
        shutil.rmtree(path, ignore_errors=True)
    trainer = name in TRAINER_CASES
    ranks = 2 if trainer else CASES[name][2]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    script = [str(Path(__file__).resolve()), "--trainer-job" if trainer else "--job", name]
    run([*torchrun, f"--nproc-per-node={ranks}", *script, str(root)])
    zero_to_fp32(name, root)
    if name in NO_UNIVERSAL:
        (root / f"{name}.ref" / "universal.txt").write_text(NO_UNIVERSAL[name])
    else:
        universal(name, root)
    for script_name in ("zero_to_fp32.py", "zero_to_torch.py"):
        (root / name / script_name).unlink(missing_ok=True)


def versions() -> dict:
    """Return the versions that wrote the goldens."""
    import accelerate
    import deepspeed
    import torch
    import transformers

    return {
        "deepspeed": deepspeed.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
    }


def main(argv: list[str]) -> None:
    if argv[:1] == ["--job"]:
        job(argv[1], Path(argv[2]))
        return
    if argv[:1] == ["--trainer-job"]:
        trainer_job(argv[1], Path(argv[2]))
        return
    for name in argv or [*CASES, *TRAINER_CASES]:
        print(f"making {name}", file=sys.stderr)
        make(name)
    (HERE / "versions.json").write_text(json.dumps(versions(), indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
