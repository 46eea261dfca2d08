"""Write the Megatron goldens: a tiny GPTModel's ``torch_dist`` checkpoint and Megatron's own load of it.

- ``gpt-tp2/``: ``dist_checkpointing.save`` of a 2-layer GPTModel (hidden 16, vocab 64)
  at tensor-parallel size 2 on 2 gloo ranks, with training's ``rng_state``
  ShardedObject (numpy and torch RNG states) and common values (``iteration``, an
  ``argparse.Namespace`` of ``args``, a scheduler dict), as megatron-core 0.16.1 writes it;
- ``reference_tp1.pt``: what ``dist_checkpointing.load`` of ``gpt-tp2/`` gives a TP=1
  copy of the model on one rank (its ``state_dict()`` without ``_extra_state``, and
  ``iteration``).

Run from the repository root in a venv with megatron-core and psutil (README.md here
gives the versions and the command); the jobs are ``tests/megatron_jobs.py``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
JOBS = HERE.parent.parent / "megatron_jobs.py"


def main() -> None:
    """Save the checkpoint with torchrun (2 ranks), then load it at TP=1 for the reference."""
    ckpt, reference = HERE / "gpt-tp2", HERE / "reference_tp1.pt"
    shutil.rmtree(ckpt, ignore_errors=True)
    reference.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
    ]
    subprocess.run([*torchrun, str(JOBS), "save", str(ckpt)], check=True, env=env)
    subprocess.run(
        [sys.executable, str(JOBS), "load", str(ckpt), str(reference)], check=True, env=env
    )


if __name__ == "__main__":
    main()
