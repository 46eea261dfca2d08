"""Every output layout streams: a checkpoint 3x the memory cap converts under the cap, bit-exact.

The cap is real and per process: each conversion runs as ``python -m shardckpt`` in a
fresh memory cgroup (``conditions.memory_capped``), under ``torchrun --no-python`` one
cgroup per rank, and the kernel kills a process that goes over. The cgroup charges
what a process makes resident: its own memory, and the page cache of what it reads and
writes, which is reclaimed when the cap is reached; so only memory a process holds on
to can get it killed. The cap is what a process that only imports shardckpt and torch
is charged (``conditions.idle_charge``: about 270 MiB with torch's CPU wheel, 560 MiB
with a CUDA build) plus ``WORK``, 240 MiB, for the work with ``--buffer-size 96MiB``:
one buffer and what a process needs beside it, not two buffers (a rank that copied a
step's reads into a file's own output buffer before writing them held twice
``--buffer-size``, and is killed).

The source (``stream_jobs``: 1.25 GiB, saved by ``dcp.save``) is over five times
``WORK`` (two and a half times the whole cap on the CPU wheel), and its 256 MiB embedding is one
stored chunk, bigger than ``WORK``: a process that held the checkpoint, a whole chunk
to read a batch of its rows, or a record it writes whole (``dcp`` at one target rank
holds the embedding as one 256 MiB record) is killed.

Values are checked against what was given to ``dcp.save`` (``stream_jobs.value``),
through torch's and safetensors' own readers of each output: ``torch.chunk`` for what
FSDP2's ``Shard(0)`` holds, torch's unpickling of the ``fsdp1-sharded`` ShardedTensors
at 2 ranks, and real FSDP1 at 2 ranks loading the ``fsdp1-local`` files (FSDP1 loading
every layout is tests/dist/test_fsdp1.py's, on a smaller model).
Each output is removed once checked: a CI disk need hold only the source and one output.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import stream_jobs
import torch
import torch.distributed.checkpoint as dcp
import warm_cli
from conditions import idle_charge, memory_capped
from harness import run_ranks
from safetensors import safe_open
from torch.distributed.tensor import DTensor, Shard

pytestmark = pytest.mark.timeout(300)

MiB = 2**20
WORK = 240 * MiB
BUFFER = "96MiB"
"""One buffer and a process's needs beside it fit WORK with room for the page cache a
busy disk leaves dirty (128 MiB left too little beside a second pytest worker); two
buffers (2 x 96 + 65 MiB) do not."""
TESTS_DIR = Path(__file__).resolve().parents[1]
MODEL = ["--model", "stream_jobs:build"]
WRAP = ["--wrap", "stream_jobs:Block"]  # only fsdp1-local's flat parameters need the wrapping


@pytest.fixture(scope="module")
def cap() -> int:
    """Return the cap per process: an idle shardckpt process's charge plus ``WORK``."""
    imports = "import shardckpt.api, shardckpt.cli.app, torch.distributed.checkpoint"
    return idle_charge([sys.executable, "-c", imports]) + WORK


@pytest.fixture(scope="module")
def source(tmp_path_factory, cap):
    """Return the directory of the 1.25 GiB DCP checkpoint; removed after the module."""
    root = tmp_path_factory.mktemp("streaming")
    need = 2 * stream_jobs.source_bytes() + 256 * MiB
    if shutil.disk_usage(root).free < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB free under {root} for the source and one output")
    state = {"model": {k: stream_jobs.value(k) for k in stream_jobs.names()}, "step": 7}
    dcp.save(state, checkpoint_id=root / "src", no_dist=True)
    del state
    assert stream_jobs.source_bytes() >= 5 * WORK
    assert stream_jobs.VOCAB * stream_jobs.DIM * 4 > WORK  # the embedding, one fp32 chunk
    yield root / "src"
    shutil.rmtree(root, ignore_errors=True)


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", SHARDCKPT_TIMEOUT="120")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")]))
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def _expect(got: dict[str, torch.Tensor], rows: slice | None = None) -> None:
    assert sorted(got) == sorted(stream_jobs.names())
    for fqn in stream_jobs.names():
        want = stream_jobs.value(fqn)
        assert torch.equal(got[fqn], want if rows is None else want[rows]), fqn


def _check_torch(out: Path) -> None:
    _expect(torch.load(out, mmap=True, weights_only=True)["model"])


def _check_safetensors(out: Path) -> None:
    with safe_open(out, "pt") as f:
        _expect({k.removeprefix("model."): f.get_tensor(k) for k in f.keys()})


def _check_hf(out: Path) -> None:
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) > 1, "--max-shard-size 300MB must split the model into shards"
    got: dict[str, torch.Tensor] = {}
    for shard in shards:
        with safe_open(shard, "pt") as f:
            got.update({k: f.get_tensor(k) for k in f.keys()})
    _expect(got)


def _check_dcp(world_size: int):
    def check(out: Path) -> None:
        assert sorted(p.name for p in out.iterdir()) == [".metadata"] + [
            f"__{r}_0.distcp" for r in range(world_size)
        ]
        # DCP's own load, into memory rather than into another 1.25 GiB file.
        model = {k: torch.empty_like(stream_jobs.value(k)) for k in stream_jobs.names()}
        dcp.load({"model": model}, checkpoint_id=out, no_dist=True)
        _expect(model)

    return check


def _check_fsdp2_ranks(out: Path) -> None:
    world_size = 3
    assert sorted(p.name for p in out.iterdir()) == [f"rank_{r}.pt" for r in range(world_size)]
    for rank in range(world_size):
        model = torch.load(out / f"rank_{rank}.pt", mmap=True, weights_only=False)["model"]
        assert sorted(model) == sorted(stream_jobs.names())
        for fqn, leaf in model.items():
            assert isinstance(leaf, DTensor) and leaf.placements == (Shard(0),), (rank, fqn)
            # FSDP2's Shard(0) holds torch.chunk's pieces.
            want = torch.chunk(stream_jobs.value(fqn), world_size)[rank]
            assert torch.equal(leaf._local_tensor, want), (rank, fqn)


def _check_fsdp1(job):
    def check(out: Path) -> None:
        assert sorted(p.name for p in out.iterdir()) == ["rank_0.pt", "rank_1.pt"]
        assert run_ranks(job, 2, str(out), timeout=240) == [[], []]

    return check


CASES = {
    "torch": (["o.pt", "--to", "full"], _check_torch),
    "safetensors": (["o.safetensors", "--to", "full"], _check_safetensors),
    "hf": (["o-hf", "--to", "full", "--format", "hf", "--max-shard-size", "300MB"], _check_hf),
    # One target rank: its file holds each tensor as one record, the embedding's 256 MiB.
    "dcp": (["o-dcp", "--to", "sharded", "--world-size", "1"], _check_dcp(1)),
    "dcp-3": (["o-dcp", "--to", "sharded", "--world-size", "3"], _check_dcp(3)),
    "fsdp2-ranks": (["o-ranks", "--to", "local", "--world-size", "3", *MODEL], _check_fsdp2_ranks),
    "fsdp1-sharded": (
        ["o-fsdp1s", "--to", "local", "--format", "fsdp1-sharded", "--world-size", "2", *MODEL],
        _check_fsdp1(stream_jobs.check_sharded_tensors),
    ),
    "fsdp1-local": (
        [
            "o-fsdp1l",
            "--to",
            "local",
            "--format",
            "fsdp1-local",
            "--world-size",
            "2",
            *MODEL,
            *WRAP,
        ],
        _check_fsdp1(stream_jobs.check_fsdp1_local),
    ),
}
# Every layout standalone (dcp at one target rank), and six under torchrun on 2 ranks
# (dcp at 3 target ranks), each rank under a cap of its own.
TORCHRUN = ("torch", "safetensors", "hf", "dcp-3", "fsdp2-ranks", "fsdp1-sharded")
RUNS = [(fmt, 1) for fmt in CASES if fmt != "dcp-3"] + [(fmt, 2) for fmt in TORCHRUN]


@pytest.mark.parametrize("fmt, nproc", RUNS, ids=[f"{f}-N{n}" for f, n in RUNS])
def test_every_layout_converts_a_checkpoint_three_times_its_memory_cap_bit_exact(
    source, cap, tmp_path, fmt, nproc
):
    (name, *options), check = CASES[fmt]
    out = tmp_path / name
    argv = [sys.executable, "-m", "shardckpt", "convert", str(source), str(out), *options]
    argv += ["--buffer-size", BUFFER, "--quiet"]
    try:
        with memory_capped(cap, processes=nproc) as groups:
            if nproc > 1:
                # torchrun's agent (uncapped) forks warm; each rank starts fresh in its cgroup.
                argv = [
                    "--standalone",
                    f"--nproc-per-node={nproc}",
                    "--no-python",
                    *groups.prefix,
                    *argv,
                ]
                proc = warm_cli.run_torchrun(argv, env=_env(), timeout=240)
            else:
                argv = [*groups.prefix, *argv]
                proc = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=240)
            assert proc.returncode == 0, (
                f"killed under the {cap // MiB} MiB cap (rc {proc.returncode}): {proc.stderr[-2000:]}"
                if proc.returncode in (-9, 137, 1)
                else proc.stderr
            )
        check(out)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)
