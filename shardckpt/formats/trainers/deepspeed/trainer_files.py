"""The HF Trainer's files beside DeepSpeed's in a ``checkpoint-N/``, carried into DST at M.

``Trainer._save_checkpoint`` with DeepSpeed writes the engine's run (``latest``,
``global_stepN/``) into ``checkpoint-N/`` beside its own files: ``trainer_state.json``,
``training_args.bin``, the model's weights and config, the tokenizer's files, the
scheduler, and one ``rng_state_{R}.pth`` per process. Written at M, DST gets them as they
are (``Trainer.train(resume_from_checkpoint=DST)`` reads them), the RNG states of the
ranks that exist at M only: the Trainer of a process without one resumes with a fresh
RNG, as it says in its log.
"""

from __future__ import annotations

import re
from pathlib import Path

from shardckpt.formats.trainers.deepspeed import names

TRAINER_STATE = "trainer_state.json"
RNG_FILE = re.compile(r"rng_state_(\d+)\.pth")
# What DeepSpeed's engine writes into the run directory: written anew, or not at all.
DEEPSPEED_OWN = (names.LATEST, "zero_to_fp32.py", "zero_to_torch.py")


def trainer_files(src: Path, tag: Path, world_size: int) -> tuple[list[str], list[str]]:
    """Return the names in ``src`` to carry into DST at ``world_size``, and what to say about RNG states.

    Empty unless ``src`` is a Trainer's checkpoint (it holds ``trainer_state.json``). A
    tag directory, the one written or an older one, is never carried.
    """
    if tag == src or not (src / TRAINER_STATE).is_file():
        return [], []
    carried, dropped, ranks = [], [], []
    for name in names.listing(src):
        path = src / name
        if name in DEEPSPEED_OWN or path == tag or (path.is_dir() and names.is_tag_dir(path)):
            continue
        if (m := RNG_FILE.fullmatch(name)) is not None:
            ranks.append(int(m.group(1)))
            if int(m.group(1)) >= world_size:
                dropped.append(name)
                continue
        carried.append(name)
    notes = []
    if dropped:
        notes.append(
            f"not carried: {', '.join(sorted(dropped, key=_rank))} (no such rank at world size "
            f"{world_size})"
        )
    missing = [r for r in range(world_size) if r not in ranks]
    if ranks and missing:
        notes.append(
            f"SRC holds no RNG state of rank{'s' if len(missing) > 1 else ''} "
            f"{', '.join(map(str, missing))}: the Trainer resumes "
            f"{'them' if len(missing) > 1 else 'it'} with a fresh RNG"
        )
    return carried, notes


def _rank(name: str) -> int:
    m = RNG_FILE.fullmatch(name)
    return int(m.group(1)) if m else -1
