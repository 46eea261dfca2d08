"""Ranks agree on the device before any CUDA work: no mix of GPUs, ranks and --device hangs.

Measured on a machine with one GPU: under ``torchrun --nproc-per-node 2`` rank 0 asked
for ``cpu:gloo,cuda:nccl`` and rank 1 for ``gloo``, and both waited forever. Now every
rank joins a gloo group, and the ranks agree there on how many of them have a GPU of
their own. Each case below runs on 2 real rank processes that see a faked number of
GPUs (``fake_gpus``): none, one for the two of them (so only local rank 0 has one), or
two (one per rank), with ``--device`` unset, ``cpu`` and ``cuda``.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket

import fake_gpus
import pytest
import torch

from shardckpt.core.dist import device_for
from shardckpt.core.errors import UsageError

WORLD = 2
ONLY_ONE = (
    "shardckpt: note: running on CPU: 1 of the 2 ranks have a GPU of their own "
    "(pass --device cpu to say so and silence this note)"
)


def _refused(with_gpu: int) -> str:
    return (
        f"shardckpt: error: --device cuda was given but only {with_gpu} of the 2 ranks have a "
        "GPU of their own: use --device cpu, or launch one process per GPU"
    )


# (GPUs each process sees, --device) -> (exit code, rank 0's stderr lines, device type chosen)
CASES = {
    (0, None): (0, [], "cpu"),
    (0, "cpu"): (0, [], "cpu"),
    (0, "cuda"): (2, [_refused(0)], None),
    (1, None): (0, [ONLY_ONE], "cpu"),
    (1, "cpu"): (0, [], "cpu"),
    (1, "cuda"): (2, [_refused(1)], None),
    (2, None): (0, [], "cuda"),
    (2, "cpu"): (0, [], "cpu"),
    (2, "cuda"): (0, [], "cuda"),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Run every case on 2 rank processes; return {case: [(code, stderr, device) per rank]}."""
    root = tmp_path_factory.mktemp("devices")
    src = root / "src.pt"
    torch.save({"w": torch.arange(6.0)}, src)
    cases = []
    for i, (gpus, device) in enumerate(CASES):
        argv = ["convert", str(src), str(root / f"out{i}.pt"), "--to", "full", "-q"]
        cases.append((gpus, argv + (["--device", device] if device else []), _free_port()))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=fake_gpus.run_cases, args=(r, WORLD, cases, results))
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    got: dict = {}
    try:
        for _ in range(len(cases) * WORLD):
            i, rank, code, err, chosen = results.get(timeout=150)
            got.setdefault(list(CASES)[i], [None] * WORLD)[rank] = (code, err, chosen)
    except queue.Empty:
        pytest.fail(f"a case hung: only these ended: {sorted(got)}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return got, root


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", list(CASES), ids=[f"gpus{g}-device-{d}" for g, d in CASES])
def test_every_mix_of_gpus_ranks_and_device_ends_with_the_right_outcome(outcomes, case):
    got, root = outcomes
    code, lines, device = CASES[case]
    (code0, err0, dev0), (code1, err1, dev1) = got[case]
    assert (code0, code1) == (code, code)
    assert err0.splitlines() == lines
    assert err1 == ""  # rank 1 says nothing: the coordinator reports
    assert (dev0, dev1) == (device, device)
    out = root / f"out{list(CASES).index(case)}.pt"
    assert out.exists() == (code == 0)
    if code == 0:
        assert torch.equal(torch.load(out, weights_only=True)["w"], torch.arange(6.0))


@pytest.mark.parametrize(
    "requested, with_gpu, expected",
    [
        (None, 4, "cuda"),
        (None, 3, "cpu"),
        (None, 0, "cpu"),
        ("cpu", 4, "cpu"),
        ("cuda", 4, "cuda"),
    ],
)
def test_the_device_is_cuda_only_when_every_rank_has_a_gpu(requested, with_gpu, expected):
    assert device_for(requested, with_gpu, 4) == expected


def test_cuda_asked_for_without_a_gpu_on_every_rank_is_a_usage_error():
    with pytest.raises(UsageError, match="only 3 of the 4 ranks"):
        device_for("cuda", 3, 4)
