"""DeepSpeed ZeRO saves (the real library's goldens, 2 ranks) moved to FSDP2 at 3: ``--to sharded
--world-size 3`` loads with ``dcp.load`` + ``set_state_dict`` into a fresh FSDP2 job, model
and optimizer equal to DeepSpeed's own (``zero_to_fp32.py``'s weights, ``ds_to_universal``'s
moments), and a training step runs; N ranks of shardckpt split the reading and write what
one process writes."""

from __future__ import annotations

import deepspeed_jobs as jobs
import pytest
import ranks
import torch
from deepspeed_goldens import (
    CASES,
    MOMENTS,
    bits_equal,
    gathered,
    run_dir,
    universal_states,
    zero_to_fp32,
)
from harness import run_ranks

from shardckpt import api

RESUMED = ["z1-bf16", "z2-fp32", "z3-bf16", "z3-fp32-sub3", "z1-bf16-fp32acc"]


@pytest.mark.parametrize("name", RESUMED)
def test_fsdp2_at_3_resumes_model_and_optimizer_deepspeed_saved(tmp_path, name):
    dst = tmp_path / "at3"
    api.convert(api.ConvertRequest(src=run_dir(name), dst=dst, to="sharded", world_size=3, verify=True))
    assert sorted(p.name for p in dst.iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"
    ]  # fmt: skip
    assert_resumed(name, run_ranks(jobs.resume, 3, str(dst))[0])


@pytest.mark.parametrize("name", ["z2-bf16", "z3-fp32"])
def test_fsdp2_at_3_resumes_from_per_rank_files_too(tmp_path, name):
    # Parameters, frozen ones included, are FSDP2's shards in each rank's file; buffers whole.
    dst = tmp_path / "ranks"
    api.convert(api.ConvertRequest(src=run_dir(name), dst=dst, to="local", world_size=3, verify=True))
    assert_resumed(name, run_ranks(jobs.resume, 3, str(dst), True)[0])


def assert_resumed(name: str, got: dict) -> None:
    """Assert the FSDP2 job holds what DeepSpeed saved, and that a step moved it."""
    job, reference = gathered(name), zero_to_fp32(name)
    # Every weight as zero_to_fp32.py (or, where it refuses the run, the job's gather) has it.
    weights = reference or {**job["fp32"], "head.weight": job["fp32"]["embed.weight"]}
    for fqn, tensor in weights.items():
        assert bits_equal(got["model"][fqn], tensor), fqn
    # The frozen Linear too (which zero_to_fp32.py leaves out of a ZeRO-1 save), and buffers.
    for fqn in ("frozen.weight", "frozen.bias", "pos", "count"):
        assert bits_equal(got["model"][fqn], job["module"][fqn].to(got["model"][fqn].dtype)), fqn
    files = universal_states(name)
    state = got["optim"]["state"]
    assert set(state) == set(job["fp32"])
    for fqn in job["fp32"]:
        for moment in MOMENTS:
            assert bits_equal(state[fqn][moment], files[fqn][moment]), (fqn, moment)
        assert state[fqn]["step"].item() == 3
    groups = got["optim"]["param_groups"]
    assert [sorted(g["params"]) for g in groups] == [sorted(f) for f in job["group_fqns"]]
    assert [g["lr"] for g in groups] == [g["lr"] for g in job["param_groups"]]
    # A step runs from there and moves every trainable weight.
    assert torch.isfinite(torch.tensor(got["loss"]))
    for fqn in job["fp32"]:
        assert not torch.equal(got["after"][fqn], got["model"][fqn]), fqn


@pytest.mark.parametrize("name", ["z2-bf16", "z3-fp32-sub3"])
def test_two_ranks_read_their_rows_and_write_what_one_process_writes(tmp_path, name):
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    api.convert(api.ConvertRequest(src=run_dir(name), dst=one, to="full"))
    run_ranks(ranks.convert, 2, str(run_dir(name)), str(two), "full", {"buffer_bytes": 256})
    assert one.read_bytes() == two.read_bytes()
    assert CASES[name][0] in (2, 3)


@pytest.mark.trainers
@pytest.mark.parametrize("name", ["hf-z2-bf16", "hf-z3-bf16"])
def test_an_hf_trainer_run_resumes_in_fsdp2_at_3(tmp_path, name):
    pytest.importorskip("transformers")
    dst = tmp_path / "at3"
    api.convert(api.ConvertRequest(src=run_dir(name), dst=dst, to="sharded", world_size=3))
    got = run_ranks(jobs.resume_llama, 3, str(dst), str(run_dir(name)))[0]
    reference = zero_to_fp32(name)
    assert all(bits_equal(got["model"][k], v) for k, v in reference.items())
    shapes = {k: v.shape for k, v in reference.items() if k != "lm_head.weight"}
    files = universal_states(name, shapes)
    assert set(got["optim"]["state"]) == set(shapes)
    for fqn, state in got["optim"]["state"].items():
        assert all(bits_equal(state[m], files[fqn][m]) for m in MOMENTS), fqn
        assert state["step"].item() == 3
    saved = api.inspect(api.InspectRequest(src=run_dir(name))).index.tree["optim"]["param_groups"]
    assert [g["lr"] for g in got["optim"]["param_groups"]] == [g["lr"] for g in saved] == [0.0]
    assert torch.isfinite(torch.tensor(got["loss"]))
    for fqn in shapes:
        assert not torch.equal(got["after"][fqn], got["model"][fqn]), fqn
