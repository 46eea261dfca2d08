"""Write the goldens of ``--format deepspeed``: DeepSpeed's own save, at M, of a conversion it loaded.

    DS_ACCELERATOR=cpu PYTHONPATH=. python tests/goldens/deepspeed/written.py [CASE-MM ...]

needs deepspeed (0.19.8 was used) and shardckpt. For each entry of ``WRITTEN`` it
converts the golden run ``CASE`` with ``shardckpt convert --to local --format deepspeed
--world-size M``, has a DeepSpeed job at M (``tests/deepspeed_resume.py``) load it with
``engine.load_checkpoint(load_optimizer_states=True, load_lr_scheduler_states=True)`` and
save it again with ``engine.save_checkpoint``, and keeps

- ``written/CASE-MM/``: that save (DeepSpeed's files at M; the recovery scripts removed);
- ``written/CASE-MM.held.pt``: what the job held once loaded (each fp32 master gathered
  with ``safe_get_full_fp32_param``, ``global_steps``, the scheduler, the loss of one batch).

``tests/unit/test_deepspeed_write.py`` compares shardckpt's conversion with these files,
without DeepSpeed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent.parent
OUT = HERE / "written"
WRITTEN = {"z1-fp32-M1": 1, "z2-bf16-M3": 3, "z3-fp32-M3": 3, "z3-bf16-M1": 1}


def case_of(name: str) -> str:
    """Return the golden run an entry converts (``z2-bf16`` of ``z2-bf16-M3``)."""
    return name.rsplit("-M", 1)[0]


def write(name: str) -> None:
    """Convert, load and save again one entry into ``OUT``."""
    m = WRITTEN[name]
    dst, held = OUT / name, OUT / f"{name}.held.pt"
    shutil.rmtree(dst, ignore_errors=True)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        converted = Path(tmp) / "ds"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "shardckpt",
                "convert",
                str(HERE / case_of(name)),
                str(converted),
            ]
            + ["--to", "local", "--format", "deepspeed", "--world-size", str(m)],
            check=True,
        )
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        argv += [f"--nproc-per-node={m}", str(TESTS / "deepspeed_resume.py"), case_of(name)]
        subprocess.run([*argv, str(converted), str(held), str(dst)], env=env, check=True)
    for script in ("zero_to_fp32.py", "zero_to_torch.py"):
        (dst / script).unlink(missing_ok=True)


if __name__ == "__main__":
    OUT.mkdir(exist_ok=True)
    for entry in sys.argv[1:] or WRITTEN:
        print(f"writing {entry}", file=sys.stderr)
        write(entry)
