"""One rule for options (issue 10, item 5): an option that does not apply is a usage error.

So is a single-valued option given twice. The table of which option applies where is
``shardckpt/api/applies.py``; these cases run the real CLI on real files.
"""

from __future__ import annotations

import pytest
import torch
from optim_models import tiny

from shardckpt.api.applies import CONVERT_RULES, INSPECT_RULES, Choice, check
from shardckpt.cli.app import run
from shardckpt.core.errors import UsageError


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    root = tmp_path_factory.mktemp("rules")
    model = tiny()
    optim = torch.optim.AdamW(model.parameters())
    model(torch.tensor([[1, 2]])).sum().backward()
    optim.step()
    torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, root / "src.pt")
    return root / "src.pt"


def error_of(capsys, argv) -> tuple[int, str]:
    code = run([str(a) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


# (--to and extra options, the one-line error without "shardckpt: error: ")
NOT_APPLYING = [
    (
        ["--to", "full", "--world-size", "2"],
        "--world-size applies to sharded and local outputs only: drop --world-size",
    ),
    (
        ["--to", "full", "--max-shard-size", "1GB"],
        "--max-shard-size applies to --format hf only: drop --max-shard-size, or pass --format hf",
    ),
    (
        ["--to", "full", "--hf-config", "."],
        "--hf-config applies to --format hf only (it copies config.json beside the weights): "
        "drop --hf-config, or pass --format hf",
    ),
    (
        ["--to", "full", "--use-orig-params"],
        "--use-orig-params applies to --format fsdp1-local output only (an fsdp1-local SRC says "
        "which layout it has): drop --use-orig-params",
    ),
    (
        ["--to", "sharded", "--world-size", "2", "--use-orig-params"],
        "--use-orig-params applies to --format fsdp1-local output only (an fsdp1-local SRC says "
        "which layout it has): drop --use-orig-params",
    ),
    (
        ["--to", "sharded", "--world-size", "2", "--zero-stage", "3"],
        "--zero-stage applies to --format deepspeed output only: drop --zero-stage, or pass "
        "--format deepspeed",
    ),
    (
        ["--to", "full", "--wrap", "optim_models:Tiny"],
        "--wrap needs --model (it names classes of the module --model builds): "
        "add --model pkg.module:factory, or drop --wrap",
    ),
    (
        ["--to", "full", "--wrap", "optim_models:Tiny", "--model", "optim_models:tiny"],
        "--wrap applies to fsdp1-local and verl-fsdp1 sources and outputs only (FSDP1 flat-parameter layouts): "
        "drop --wrap",
    ),
    (
        ["--to", "full", "--cast-optim"],
        "--cast-optim needs --dtype: add --dtype bf16, fp16 or fp32, or drop --cast-optim",
    ),
    (
        ["--to", "full", "--dtype", "bf16", "--cast-optim", "--only", "model"],
        "--cast-optim applies to optimizer state, and this output holds none (--only model, or "
        "--format hf): drop --cast-optim",
    ),
    (
        ["--to", "full", "--optim-keys", "id", "--only", "model"],
        "--optim-keys applies to optimizer state, and this output holds none (--only model, or "
        "--format hf): drop --optim-keys",
    ),
    (
        ["--to", "sharded", "--world-size", "2", "--format", "torchtitan", "--optim-keys", "fqn"],
        "--optim-keys cannot nest the optimizer of --format torchtitan, which loads it "
        "flattened: drop --optim-keys, or pass --optim-keys flat",
    ),
    (
        ["--to", "full", "--dtype", "bf16", "--only", "optim"],
        "--dtype casts model tensors, and --only optim writes none: add --cast-optim to cast "
        "optimizer state, or drop --dtype",
    ),
    (
        ["--to", "full", "--src-local"],
        "--src-local applies under torchrun, where ranks on several nodes read SRC: "
        "drop --src-local, or launch with torchrun",
    ),
    (
        ["--to", "full", "--format", "hf", "--nest", "model"],
        "--nest has nothing to act on in --format hf, which names tensors by their FQN alone: "
        "drop --nest",
    ),
    (
        ["--to", "full", "--only", "model", "--only", "optim"],
        "--only given more than once: pass it once: it is not repeatable, and only the last "
        "would count",
    ),
    (
        ["--to", "full", "--format", "torch", "--format", "safetensors"],
        "--format given more than once: pass it once: it is not repeatable, and only the last "
        "would count",
    ),
    (["--to", "full", "-q", "--quiet"], "-q and --quiet both given: keep one of them"),
    (
        ["--to", "full", "--clean-fqns", "--no-clean-fqns"],
        "--clean-fqns and --no-clean-fqns both given: keep one of them",
    ),
]


@pytest.mark.parametrize(("extra", "line"), NOT_APPLYING, ids=lambda v: " ".join(v)[:60])
def test_an_option_that_does_not_apply_is_a_usage_error(capsys, src, tmp_path, extra, line):
    dst = tmp_path / ("out.pt" if "full" in extra else "out")
    assert error_of(capsys, ["convert", src, dst, *extra]) == (2, f"shardckpt: error: {line}")
    assert not dst.exists()


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--json", "--json"], "--json given more than once"),
        (["--model", "optim_models:tiny"], "--model applies to fsdp1-local and veRL sources only"),
        (["--wrap", "optim_models:Tiny"], "--wrap needs --model"),
    ],
)
def test_inspect_follows_the_same_rule(capsys, src, argv, line):
    code, err = error_of(capsys, ["inspect", src, *argv])
    assert (code, err.startswith(f"shardckpt: error: {line}")) == (2, True), err


def test_diff_refuses_a_repeated_option(capsys, src):
    code, err = error_of(capsys, ["diff", src, src, "--atol", "1", "--atol", "2"])
    assert (code, err) == (
        2,
        "shardckpt: error: --atol given more than once: pass it once: it is not repeatable, "
        "and only the last would count",
    )


def test_repeatable_options_and_values_that_look_like_options_stay_allowed(src, tmp_path):
    argv = ["convert", src, tmp_path / "o.pt", "--to", "full", "--filter", "model.*"]
    argv += ["--filter", "optim.*", "--rename=^fc=--only", "--drop", "^norm", "--dry-run"]
    assert run([str(a) for a in argv]) == 0


def test_an_option_that_applies_is_accepted(src, tmp_path):
    argv = ["convert", src, tmp_path / "hf", "--to", "full", "--format", "hf"]
    argv += ["--max-shard-size", "1MB", "--dtype", "bf16", "--only", "model"]
    assert run([str(a) for a in argv]) == 0


# The pure table: every rule refuses its option when given where it does not apply.
@pytest.mark.parametrize(
    ("rules", "choice", "option"),
    [
        (CONVERT_RULES, Choice(to="full", fmt="torch", world_size=2), "--world-size"),
        (CONVERT_RULES, Choice(to="full", fmt="torch", max_shard_size=1), "--max-shard-size"),
        (CONVERT_RULES, Choice(to="full", fmt="safetensors", hf_config="d"), "--hf-config"),
        (
            CONVERT_RULES,
            Choice(to="local", fmt="fsdp2-ranks", use_orig_params=True),
            "--use-orig-params",
        ),
        (CONVERT_RULES, Choice(to="local", fmt="fsdp2-ranks", zero_stage=2), "--zero-stage"),
        (CONVERT_RULES, Choice(to="full", fmt="torch", wraps=("m:C",)), "--wrap"),
        (
            CONVERT_RULES,
            Choice(to="full", fmt="torch", src_format="dcp", model="m:f", wraps=("m:C",)),
            "--wrap",
        ),
        (CONVERT_RULES, Choice(to="full", fmt="torch", cast_optim=True), "--cast-optim"),
        (CONVERT_RULES, Choice(to="full", fmt="hf", dtype="bf16", cast_optim=True), "--cast-optim"),
        (CONVERT_RULES, Choice(to="full", fmt="hf", optim_keys="id"), "--optim-keys"),
        (CONVERT_RULES, Choice(to="sharded", fmt="torchtitan", optim_keys="id"), "--optim-keys"),
        (CONVERT_RULES, Choice(to="full", fmt="torch", only="optim", dtype="fp16"), "--dtype"),
        (CONVERT_RULES, Choice(to="full", fmt="torch", src_local=True), "--src-local"),
        (INSPECT_RULES, Choice(wraps=("m:C",)), "--wrap"),
        (INSPECT_RULES, Choice(src_format="dcp", model="m:f"), "--model"),
    ],
)
def test_the_table_refuses_each_option_where_it_does_not_apply(rules, choice, option):
    with pytest.raises(UsageError) as caught:
        check(rules, choice)
    assert caught.value.message.startswith(f"{option} ")


@pytest.mark.parametrize(
    ("rules", "choice"),
    [
        (CONVERT_RULES, Choice(to="sharded", fmt="dcp", world_size=2)),
        (CONVERT_RULES, Choice(to="full", fmt="hf", max_shard_size=1)),
        (CONVERT_RULES, Choice(to="full", fmt="hf", hf_config="d")),
        (
            CONVERT_RULES,
            Choice(
                to="local", fmt="fsdp1-local", use_orig_params=True, model="m:f", wraps=("m:C",)
            ),
        ),
        (
            CONVERT_RULES,
            Choice(to="full", fmt="torch", src_format="fsdp1-local", model="m:f", wraps=("m:C",)),
        ),
        (CONVERT_RULES, Choice(to="local", fmt="deepspeed", zero_stage=3)),
        (CONVERT_RULES, Choice(to="full", fmt="torch", model="m:f", wraps=("m:C",))),
        (
            CONVERT_RULES,
            Choice(to="full", fmt="torch", only="optim", dtype="fp16", cast_optim=True),
        ),
        (CONVERT_RULES, Choice(to="full", fmt="torch", src_local=True, distributed=True)),
        (CONVERT_RULES, Choice(to="sharded", fmt="torchtitan", optim_keys="flat")),
        (INSPECT_RULES, Choice(src_format="fsdp1-local", model="m:f", wraps=("m:C",))),
    ],
)
def test_the_table_accepts_each_option_where_it_applies(rules, choice):
    check(rules, choice)
