"""Checkpoints saved by the trainers themselves, on CPU in one process, for the object-storage tests.

``python trainer_saves.py trainer DIR``: a transformers ``Trainer`` fine-tunes a small
Llama (untied embeddings) for 2 steps with AdamW and saves; ``DIR`` becomes its
``checkpoint-2/`` (``model.safetensors``, ``optimizer.pt``, ``scheduler.pt``,
``rng_state.pth``, ``trainer_state.json``, ``training_args.bin``, the model's config).
``python trainer_saves.py accelerate DIR``: ``Accelerator.save_state(DIR)`` of a small MLP
trained 2 steps with AdamW and a scheduler (``model.safetensors``, ``optimizer.bin``,
``scheduler.bin``, ``random_states_0.pkl``).

Each runs in a process of its own: both libraries keep process-wide state (accelerate's).
Sizes are a few MiB, so that each weight and optimizer file spans several ranged requests
(``core.remote_files.PART``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")


def save(kind: str, dst: Path) -> Path:
    """Return ``dst``, where a subprocess saved the ``kind`` (``trainer``, ``accelerate``) checkpoint."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    subprocess.run([sys.executable, __file__, kind, str(dst)], check=True, env=env)
    return dst


class Tokens:
    """8 sequences of 8 token ids, each its own labels."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(2048, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def trainer(dst: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    out = dst.parent / f"{dst.name}.out"
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=2,
        max_steps=2,
        save_steps=2,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        logging_strategy="no",
    )
    Trainer(model=LlamaForCausalLM(config), args=args, train_dataset=Tokens()).train()
    os.replace(out / "checkpoint-2", dst)
    shutil.rmtree(out)


def accelerate(dst: Path) -> None:
    from accelerate import Accelerator

    torch.manual_seed(0)
    acc = Accelerator(cpu=True)
    model = torch.nn.Sequential(
        torch.nn.Linear(768, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    model, opt, sched = acc.prepare(model, opt, sched)
    for _ in range(2):
        acc.backward(model(torch.randn(4, 768)).square().mean())
        opt.step()
        sched.step()
        opt.zero_grad()
    acc.save_state(str(dst))


if __name__ == "__main__":
    torch.set_num_threads(1)
    {"trainer": trainer, "accelerate": accelerate}[sys.argv[1]](Path(sys.argv[2]))
