"""Checkpoints saved by the trainers themselves, on CPU in one process, for the object-storage tests.

``python trainer_saves.py trainer DIR``: a transformers ``Trainer`` fine-tunes a small
Llama (untied embeddings) for 2 steps with AdamW and saves; ``DIR`` becomes its
``checkpoint-2/`` (``model.safetensors``, ``optimizer.pt``, ``scheduler.pt``,
``rng_state.pth``, ``trainer_state.json``, ``training_args.bin``, the model's config).
``python trainer_saves.py trainer-fsdp DIR``: the same under FSDP2 with full state dicts
(a one-process gloo job): ``model.safetensors``, ``pytorch_model_fsdp.bin`` and
``optimizer.bin`` (accelerate's ``save_fsdp_model``/``save_fsdp_optimizer``, FQN-keyed)
in place of ``optimizer.pt``.
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
    """Return ``dst``, where a subprocess saved the ``kind`` (``trainer``, ``trainer-fsdp``, ``accelerate``) checkpoint."""
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


def trainer(dst: Path, fsdp: bool = False) -> None:
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
        **(dict(fsdp=True, fsdp_config=FSDP_FULL) if fsdp else {}),
    )
    kind = _fsdp_on_cpu(Trainer) if fsdp else Trainer
    kind(model=LlamaForCausalLM(config), args=args, train_dataset=Tokens()).train()
    os.replace(out / "checkpoint-2", dst)
    shutil.rmtree(out)


FSDP_FULL = {"fsdp_version": 2, "state_dict_type": "FULL_STATE_DICT"}


def _fsdp_on_cpu(trainer_class):
    """Return a ``Trainer`` that runs accelerate's FSDP path on CPU, in a one-process gloo job.

    accelerate applies its FSDP plugin on accelerators only; on CPU the job is told it is
    an FSDP one (as ``tests/accelerate_train.py`` does), so from ``prepare()`` on the model
    is ``fully_shard``ed and the checkpoint is saved by accelerate's FSDP functions.
    """
    import socket

    from accelerate import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    os.environ.update(env, MASTER_PORT=str(port))

    class FsdpOnCpu(trainer_class):
        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            state = self.accelerator.state
            PartialState().distributed_type = state.distributed_type = DistributedType.FSDP
            state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            self.is_fsdp_enabled = True

    return FsdpOnCpu


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
    kinds = {"trainer": trainer, "accelerate": accelerate}
    kinds["trainer-fsdp"] = lambda dst: trainer(dst, fsdp=True)
    kinds[sys.argv[1]](Path(sys.argv[2]))
