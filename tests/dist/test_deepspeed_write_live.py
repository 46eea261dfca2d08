"""The real library, live: a ZeRO save converted to ``--format deepspeed`` at M is resumed by
DeepSpeed's own ``engine.load_checkpoint`` at M as the run itself.

Each golden (a DeepSpeed save at 2 ranks, or 3) is converted for M ranks and loaded by a
DeepSpeed job at M (``tests/deepspeed_resume.py``, torchrun, gloo, CPU accelerator) with
``load_optimizer_states=True, load_lr_scheduler_states=True``: every fp32 master
(``safe_get_full_fp32_param``) equals what the run held when it saved, bit for bit;
``global_steps``, the scheduler and the client state continue; the Adam moments, as
DeepSpeed saves them again at M, equal ``ds_to_universal``'s of the run; and a step on a
batch every rank is given alike has the loss, and leaves the masters, of the run resumed
natively at its own world size. Runs only where deepspeed is installed,
``pip install -e '.[deepspeed]'`` (``tests/unit/test_deepspeed_write.py`` checks the same
conversions against DeepSpeed's files without it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import deepspeed_jobs as jobs
from deepspeed_goldens import MOMENTS, bits_equal, gathered, run_dir, universal_states
from harness import run_ranks

from shardckpt import api

pytestmark = [pytest.mark.trainers, pytest.mark.timeout(1800)]
pytest.importorskip(
    "deepspeed", reason="deepspeed is not installed (pip install -e '.[deepspeed]')"
)

TESTS = Path(__file__).resolve().parent.parent
CLIENT_STATE = {"epoch": 1, "note": "tiny"}
# golden: the world sizes it is written for and resumed at. (No fp16 run: DeepSpeed's CPU
# accelerator trains fp16 only on CPUs with fp16 arithmetic, "Type fp16 is not supported on
# your device" elsewhere; tests/unit/test_deepspeed_write.py reads its conversions back.)
CASES = [
    ("z1-fp32", 1),
    ("z1-fp32", 3),
    ("z1-fp32", 4),
    ("z2-bf16", 1),
    ("z2-bf16", 3),
    ("z2-bf16", 4),
    ("z3-fp32", 1),
    ("z3-fp32", 3),
    ("z3-fp32", 4),
    ("z3-bf16", 4),
    ("z3-fp32-sub3", 2),
]
RANKS = {"z3-fp32-sub3": 3}


def resume(
    case: str, ranks: int, src: Path, out: Path, resave: Path | None = None, *extra: str
) -> dict:
    """Run ``deepspeed_resume.py`` at ``ranks`` on ``src``; return what rank 0 saved."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    argv += [
        f"--nproc-per-node={ranks}",
        str(TESTS / "deepspeed_resume.py"),
        case,
        str(src),
        str(out),
    ]
    argv += [str(resave)] if resave is not None else []
    argv += list(extra)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(out, weights_only=True)


def assert_moments_of_the_run(case: str, resaved: Path, full: Path) -> None:
    """Assert the moments DeepSpeed holds at M, as it saves them again, are the run's (ds_to_universal's)."""
    api.convert(api.ConvertRequest(src=resaved, dst=full, to="full"))
    state = torch.load(full, weights_only=True)["optim"]["state"]
    moments = universal_states(case)
    assert set(state) == set(moments)
    for fqn, expected in moments.items():
        for moment in MOMENTS:
            assert bits_equal(state[fqn][moment], expected[moment]), (fqn, moment)


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """Return a maker of what the golden run holds, resumed natively at its own world size, by case."""
    made: dict[str, dict] = {}
    root = tmp_path_factory.mktemp("native")

    def get(case: str) -> dict:
        if case not in made:
            made[case] = resume(case, RANKS.get(case, 2), run_dir(case), root / f"{case}.pt")
        return made[case]

    return get


# Another ZeRO stage than the run's (--zero-stage): golden, M, stage.
STAGE_CHANGES = [("z2-bf16", 3, 3), ("z3-fp32", 2, 1), ("z1-fp32", 4, 2)]


@pytest.mark.parametrize(
    "case,m,stage",
    [(c, m, None) for c, m in CASES] + STAGE_CHANGES,
    ids=[f"{c}-M{m}" for c, m in CASES] + [f"{c}-M{m}-zero{s}" for c, m, s in STAGE_CHANGES],
)
def test_a_conversion_resumes_in_deepspeed_at_m_as_the_run(tmp_path, native, case, m, stage):
    dst = tmp_path / "ds"
    api.convert(
        api.ConvertRequest(
            src=run_dir(case),
            dst=dst,
            to="local",
            format="deepspeed",
            world_size=m,
            zero_stage=stage,
            verify=True,
        )
    )
    assert (dst / "latest").read_text() == "global_step3"
    job = case if stage is None else f"{case}:{stage}"
    held = resume(job, m, dst, tmp_path / "held.pt", tmp_path / "resaved")
    run = gathered(case)
    assert held["world_size"] == m
    assert set(held["fp32"]) == set(run["fp32"])
    for fqn, master in run["fp32"].items():
        assert bits_equal(held["fp32"][fqn], master), fqn
    assert (held["global_steps"], held["global_steps_after"]) == (3, 4)
    reference = native(case)
    assert held["lr_scheduler"] == reference["lr_scheduler"]
    assert held["global_samples"] == reference["global_samples"]
    assert held["client"] == CLIENT_STATE
    assert_moments_of_the_run(case, tmp_path / "resaved", tmp_path / "resaved.pt")
    # The next step: the loss of one batch, and the masters after it, are the native resume's.
    # At another stage a bf16 forward is not the same computation (ZeRO-3 runs its own
    # Linear on the gathered bf16 weights): equal to bf16's precision there.
    fp32 = case.endswith("fp32") or "fp32-" in case
    rel = 1e-6 if fp32 or stage is None else 1e-3
    assert held["loss"] == pytest.approx(reference["loss"], rel=rel)
    tol = 1e-6 if fp32 else 2e-3
    for fqn, after in reference["stepped"].items():
        torch.testing.assert_close(held["stepped"][fqn], after, rtol=tol, atol=tol)


@pytest.mark.parametrize("case,m,factory", [("z2-bf16", 3, "build_bf16"), ("z3-fp32", 4, "build")])
def test_fsdp2_dcp_with_its_optimizer_resumes_in_deepspeed_at_m(tmp_path, native, case, m, factory):
    """FSDP2 -> DeepSpeed: a DCP checkpoint of model and FQN-keyed optimizer alone (what FSDP2
    at 2 loads, tests/dist/test_deepspeed.py), written with --model for the module's layout."""
    dcp = tmp_path / "dcp"
    api.convert(
        api.ConvertRequest(
            src=run_dir(case), dst=dcp, to="sharded", world_size=2, filters=("model.*", "optim.*")
        )
    )
    dst = tmp_path / "ds"
    api.convert(
        api.ConvertRequest(
            src=dcp,
            dst=dst,
            to="local",
            format="deepspeed",
            world_size=m,
            model=f"deepspeed_model:{factory}",
            zero_stage=int(case[1]),
            verify=True,
        )
    )
    assert (dst / "latest").read_text() == "global_step0"
    held = resume(case, m, dst, tmp_path / "held.pt", tmp_path / "resaved", "--no-scheduler")
    for fqn, master in gathered(case)["fp32"].items():
        assert bits_equal(held["fp32"][fqn], master), fqn
    assert_moments_of_the_run(case, tmp_path / "resaved", tmp_path / "resaved.pt")
    assert (held["global_steps"], held["global_steps_after"]) == (0, 1)
    reference = native(case)
    assert held["loss"] == pytest.approx(reference["loss"], rel=1e-6)
    for fqn, after in reference["stepped"].items():
        torch.testing.assert_close(held["stepped"][fqn], after, rtol=2e-3, atol=2e-3)


def test_a_dcp_an_fsdp2_job_saved_resumes_in_deepspeed_at_3(tmp_path):
    """FSDP2 -> DeepSpeed from what FSDP2 itself wrote: a job at 2 (gloo, ``fully_shard``)
    trains a step and saves its model and FQN-keyed AdamW with ``dcp.save``; converted for
    ZeRO-3 at 3, DeepSpeed's ``load_checkpoint`` holds the job's weights as fp32 masters and
    its moments, bit for bit."""
    start = tmp_path / "start"
    api.convert(
        api.ConvertRequest(
            src=run_dir("z3-fp32"),
            dst=start,
            to="sharded",
            world_size=2,
            filters=("model.*", "optim.*"),
        )
    )
    saved = tmp_path / "fsdp2"
    job = run_ranks(jobs.train_and_save, 2, str(start), str(saved))[0]
    dst = tmp_path / "ds"
    api.convert(
        api.ConvertRequest(
            src=saved,
            dst=dst,
            to="local",
            format="deepspeed",
            world_size=3,
            model="deepspeed_model:build",
            zero_stage=3,
            verify=True,
        )
    )
    held = resume("z3-fp32", 3, dst, tmp_path / "held.pt", tmp_path / "resaved", "--no-scheduler")
    assert held["fp32"] and set(held["fp32"]) == set(job["optim"]["state"])
    for fqn, master in held["fp32"].items():
        assert bits_equal(master, job["model"][fqn]), fqn
    api.convert(
        api.ConvertRequest(src=tmp_path / "resaved", dst=tmp_path / "resaved.pt", to="full")
    )
    state = torch.load(tmp_path / "resaved.pt", weights_only=True)["optim"]["state"]
    for fqn, moments in job["optim"]["state"].items():
        for moment in MOMENTS:
            assert bits_equal(state[fqn][moment], moments[moment]), (fqn, moment)
    assert torch.isfinite(torch.tensor(held["loss"]))


@pytest.mark.parametrize("m", [1, 3])
def test_an_hf_trainer_checkpoint_at_m_resumes_in_the_trainer(tmp_path, m):
    """``Trainer.train(resume_from_checkpoint=...)`` at M continues from the saved step: the
    Trainer's DeepSpeed engine loads the ZeRO-2 run at M (at another world size than the
    one saved, DeepSpeed's own load refuses) and steps on from global step 3."""
    pytest.importorskip("transformers")
    dst = tmp_path / "checkpoint-3"
    api.convert(
        api.ConvertRequest(
            src=run_dir("hf-z2-bf16"), dst=dst, to="local", format="deepspeed", world_size=m
        )
    )
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    argv += [f"--nproc-per-node={m}", str(TESTS / "deepspeed_resume.py"), "--trainer"]
    argv += ["hf-z2-bf16", str(dst), str(tmp_path / "out.pt")]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    held = torch.load(tmp_path / "out.pt", weights_only=True)
    assert (held["world_size"], held["global_step"], held["engine_steps"]) == (m, 4, 4)


@pytest.mark.parametrize("case,m", [("z2-bf16", 3), ("z3-fp32", 2)])
def test_weights_alone_start_deepspeed_at_m_from_them(tmp_path, case, m):
    """Weights alone (a safetensors file of the fp32 weights), in --model's param groups:
    DeepSpeed loads them with ``load_optimizer_states=False``, which takes its fp32 masters
    from the module's weights (``_restore_from_bit16_weights``): the weights themselves in
    an fp32 job, their bf16 rounding in a bf16 one."""
    weights = tmp_path / "weights.safetensors"
    api.convert(
        api.ConvertRequest(
            src=run_dir(case), dst=weights, to="full", filters=("model.*",), unnest="model"
        )
    )
    dst = tmp_path / "ds"
    factory = "build_bf16_with_groups" if "bf16" in case else "build_with_groups"
    api.convert(
        api.ConvertRequest(
            src=weights,
            dst=dst,
            to="local",
            format="deepspeed",
            world_size=m,
            model=f"deepspeed_model:{factory}",
            nest="model",
            zero_stage=int(case[1]),
            verify=True,
        )
    )
    held = resume(case, m, dst, tmp_path / "held.pt", None, "--no-scheduler", "--no-optimizer")
    for fqn, master in gathered(case)["fp32"].items():
        expected = master.to(torch.bfloat16).float() if "bf16" in case else master
        assert bits_equal(held["fp32"][fqn], expected), fqn
