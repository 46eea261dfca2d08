"""``verify`` reads every format shardckpt reads, standalone and at 2 ranks, and finds the intact ones intact.

Sources: what the trainers themselves wrote (the DeepSpeed, Megatron and veRL goldens;
torch_checkpointing's manager, Lightning Fabric, a torchtitan-like job and torch's other
DCP writers on gloo ranks, as their own tests save them) and what shardckpt writes in
every format it writes, from an FSDP2 DCP checkpoint. Every file of each is read: the
bytes ``verify`` reports are the sum of the files' sizes.
"""

from __future__ import annotations

from pathlib import Path

import dcp_variants_jobs
import lightning_jobs
import pytest
import ranks
import titan_ranks
import torch_checkpointing_jobs
from harness import run_ranks

from shardckpt import api

GOLDENS = Path(__file__).resolve().parents[1] / "goldens"
# Every checkpoint the trainers wrote for the suite, and the reference files their own
# tools wrote beside them (DeepSpeed's zero_to_fp32, torch.save of the gathered state).
TRAINER_GOLDENS = sorted(
    [
        p
        for p in (GOLDENS / "deepspeed").iterdir()
        if p.is_dir() and not p.name.endswith(".ref") and p.name != "written"
    ]
    + sorted(p for p in (GOLDENS / "deepspeed").glob("*.ref/*") if p.suffix != ".txt")
    # DeepSpeed's own saves of --format deepspeed conversions it loaded, and what it held.
    + sorted((GOLDENS / "deepspeed" / "written").iterdir())
    + [GOLDENS / "megatron" / "gpt-tp2", GOLDENS / "megatron" / "reference_tp1.pt"]
    + [
        GOLDENS / "verl" / v / f
        for v in ("fsdp1", "fsdp2")
        for f in ("global_step_2", "reference.pt")
    ]
)
MODEL = {"model": "make_checkpoint:build_model", "wraps": ["make_checkpoint:Block"]}
WRITTEN = {
    "torch": ("full.pt", "full", {}),
    "safetensors": ("full.safetensors", "full", {}),
    "hf": ("hf", "full", {"format": "hf", "max_shard_size": 20_000}),
    "dcp": ("dcp", "sharded", {"world_size": 3}),
    "fsdp2-ranks": ("ranks", "local", {"world_size": 3}),
    "fsdp1-sharded": ("fsdp1s", "local", {"format": "fsdp1-sharded", "world_size": 3}),
    "fsdp1-local": (
        "fsdp1l",
        "local",
        {"format": "fsdp1-local", "world_size": 3, "only": "model", **MODEL},
    ),
    "torch-checkpointing": ("tcp", "sharded", {"format": "torch-checkpointing", "world_size": 2}),
    "lightning": ("lightning", "sharded", {"format": "lightning", "world_size": 2}),
    "accelerate": ("accelerate", "sharded", {"format": "accelerate", "world_size": 2}),
}


def file_bytes(src: Path) -> int:
    """Return the size of ``src``, or of every file under it."""
    return (
        src.stat().st_size
        if src.is_file()
        else sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    )


@pytest.fixture(scope="module")
def written(fsdp2_ckpt, tmp_path_factory) -> Path:
    """Return a directory holding the FSDP2 checkpoint converted by shardckpt into each format it writes."""
    root = tmp_path_factory.mktemp("written")
    for name, to, kwargs in WRITTEN.values():
        api.convert(api.ConvertRequest(src=fsdp2_ckpt.dcp, dst=root / name, to=to, **kwargs))
    return root


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Path]:
    """Return checkpoints the trainers' own code saved at 2 ranks, by the format they read as."""
    root = tmp_path_factory.mktemp("trained")
    run_ranks(torch_checkpointing_jobs.save, 2, str(root / "tcp" / "step-2"), timeout=300)
    run_ranks(dcp_variants_jobs.save, 2, str(root / "variants"), timeout=300)
    run_ranks(titan_ranks.save_titan_like, 2, str(root / "titan" / "step-2"), timeout=300)
    run_ranks(lightning_jobs.train_and_save, 2, str(root / "fabric"), 2, "fsdp", timeout=300)
    return {
        "torch-checkpointing": root / "tcp" / "step-2",
        "hf-storage": root / "variants" / "hf",
        "dcp-safetensors": root / "variants" / "st",
        "torchtitan": root / "titan" / "step-2",
        "lightning": root / "fabric",
    }


# torch's HF storage writer stores safetensors alone, with no checksum: its bytes are read,
# none is checked (dcp-safetensors stores its values as torch.save zips, which are).
NO_CHECKSUMS = {"hf-storage"}


def assert_intact_at_one_and_two_ranks(src: Path, checksums: bool = True) -> None:
    result = api.verify(api.VerifyRequest(src=src))
    assert (result.intact, result.damaged, result.bytes) == (True, [], file_bytes(src))
    assert (result.checked > 0) == checksums
    both = run_ranks(ranks.verify, 2, str(src), timeout=300)
    assert both == [(True, [], file_bytes(src))] * 2


@pytest.mark.parametrize("src", TRAINER_GOLDENS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_verify_finds_each_trainer_golden_intact_at_one_and_two_ranks(src):
    assert_intact_at_one_and_two_ranks(src)


@pytest.mark.parametrize("fmt", list(WRITTEN))
def test_verify_finds_what_shardckpt_wrote_intact(written, fmt):
    assert_intact_at_one_and_two_ranks(written / WRITTEN[fmt][0])


@pytest.mark.parametrize(
    "fmt", ["torch-checkpointing", "hf-storage", "dcp-safetensors", "torchtitan", "lightning"]
)
def test_verify_finds_what_a_trainer_saved_intact(trained, fmt):
    assert api.verify(api.VerifyRequest(src=trained[fmt])).format.startswith(fmt.split("-")[0])
    assert_intact_at_one_and_two_ranks(trained[fmt], checksums=fmt not in NO_CHECKSUMS)
