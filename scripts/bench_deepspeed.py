"""The DeepSpeed source of ``scripts/bench.py --source deepspeed``: a ZeRO-2 bf16 run saved by
DeepSpeed (``bench_make_deepspeed.py``), and DeepSpeed's own ``zero_to_fp32.py`` as the
reference every output's ``model`` is checked against.

Building the source and running the reference need deepspeed (and huggingface_hub, which
``zero_to_fp32.py`` imports) in the interpreter that runs the benchmark; shardckpt does not.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
DS_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
REFERENCE = "zero_to_fp32.py"
REFERENCE_FILE = "pytorch_model.bin"
"""What ``zero_to_fp32.py`` writes for a model under its 5 GB shard size."""


def source_path(workdir: Path, size_gb: float) -> Path:
    """Return where the run directory of a size lives."""
    return workdir / f"zero2-{size_gb:g}gb"


def ensure_source(workdir: Path, size_gb: float, torchrun: list[str], log) -> Path:
    """Return a ZeRO-2 run directory of size_gb in workdir, saving it with DeepSpeed if absent."""
    src = source_path(workdir, size_gb)
    if (src / "latest").is_file():
        log(f"reusing {src}")
        return src
    workdir.mkdir(parents=True, exist_ok=True)
    log(f"building {src} with DeepSpeed on 2 ranks ...")
    argv = [*torchrun, "--nproc-per-node=2", str(SCRIPTS / "bench_make_deepspeed.py")]
    subprocess.run(
        [*argv, str(src), f"--size-gb={size_gb}"],
        cwd=SCRIPTS.parent,
        env={**os.environ, **DS_ENV},
        stdout=sys.stderr,
        check=True,
    )
    return src


def reference_argv(src: Path, out_dir: Path) -> list[str]:
    """Return the command that runs the run's own ``zero_to_fp32.py`` into out_dir."""
    return [sys.executable, str(src / REFERENCE), str(src), str(out_dir)]


def largest_tensor(src: Path) -> tuple[str, int]:
    """Return the dotted path and byte size of the run's largest tensor (shardckpt's index of it)."""
    from shardckpt import api

    tensors = api.inspect(api.InspectRequest(src=src)).index.tensors()
    path, meta = max(tensors, key=lambda pm: pm[1].nbytes)
    return ".".join(map(str, path)), meta.nbytes
