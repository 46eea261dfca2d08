"""Which options apply to which run: one table, one rule (pure, no I/O).

The rule: an option given where it has nothing to act on is a usage error (exit 2),
one line naming the option and why, never silently ignored. Each ``Rule`` says when
its option counts as given and when it applies; ``check`` raises for the first rule
broken. The source's format is known only once SRC is opened, so a run is checked
twice: with ``src_format=None`` (rules about the source pass) before any input is read,
and again with the source's format.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shardckpt.core.errors import UsageError


@dataclass(frozen=True, kw_only=True, slots=True)
class Choice:
    """What a command was asked to do: the output, the source's format, the options given."""

    to: str | None = None
    """``--to`` (None for ``inspect``)."""
    fmt: str | None = None
    """The output format, default applied (None for ``inspect``)."""
    src_format: str | None = None
    """The source's format; None while not yet known."""
    only: str = "all"
    dtype: str = "keep"
    cast_optim: bool = False
    optim_keys: str = "keep"
    world_size: int | None = None
    max_shard_size: int | None = None
    model: str | None = None
    wraps: tuple[str, ...] = ()
    use_orig_params: bool = False
    zero_stage: int | None = None
    src_local: bool = False
    hf_config: str | None = None
    distributed: bool = False
    """Whether the run is under torchrun."""
    quiet: bool = False
    json_out: bool = False
    nest: str | None = None


@dataclass(frozen=True, slots=True)
class Rule:
    """``option`` is refused with ``why`` and ``hint`` when ``given`` and not ``applies``."""

    option: str
    given: Callable[[Choice], bool]
    applies: Callable[[Choice], bool]
    why: str
    hint: str


def _holds_optimizer(c: Choice) -> bool:
    return c.only != "model" and c.fmt != "hf"


def _may_be_fsdp1_local_source(c: Choice) -> bool:
    # veRL's FSDP1 optimizer files are flat parameters too.
    return c.src_format in (None, "fsdp1-local", "verl", "verl-fsdp1")


# Both commands that take --wrap read it only with the model it names classes of.
_WRAP_NEEDS_MODEL = Rule(
    "--wrap",
    lambda c: bool(c.wraps),
    lambda c: c.model is not None,
    "needs --model (it names classes of the module --model builds)",
    "add --model pkg.module:factory, or drop --wrap",
)

CONVERT_RULES: tuple[Rule, ...] = (
    Rule(
        "--world-size",
        lambda c: c.world_size is not None,
        lambda c: c.to != "full",
        "applies to sharded and local outputs only",
        "drop --world-size",
    ),
    Rule(
        "--max-shard-size",
        lambda c: c.max_shard_size is not None,
        lambda c: c.fmt == "hf",
        "applies to --format hf only",
        "drop --max-shard-size, or pass --format hf",
    ),
    Rule(
        "--hf-config",
        lambda c: c.hf_config is not None,
        lambda c: c.fmt == "hf",
        "applies to --format hf only (it copies config.json beside the weights)",
        "drop --hf-config, or pass --format hf",
    ),
    Rule(
        "--use-orig-params",
        lambda c: c.use_orig_params,
        lambda c: c.fmt == "fsdp1-local",
        "applies to --format fsdp1-local output only (an fsdp1-local SRC says which layout it has)",
        "drop --use-orig-params",
    ),
    Rule(
        "--zero-stage",
        lambda c: c.zero_stage is not None,
        lambda c: c.fmt == "deepspeed",
        "applies to --format deepspeed output only",
        "drop --zero-stage, or pass --format deepspeed",
    ),
    _WRAP_NEEDS_MODEL,
    Rule(
        "--wrap",
        lambda c: bool(c.wraps),
        lambda c: c.fmt in ("fsdp1-local", "verl-fsdp1") or _may_be_fsdp1_local_source(c),
        "applies to fsdp1-local and verl-fsdp1 sources and outputs only (FSDP1 flat-parameter layouts)",
        "drop --wrap",
    ),
    Rule(
        "--cast-optim",
        lambda c: c.cast_optim,
        lambda c: c.dtype != "keep",
        "needs --dtype",
        "add --dtype bf16, fp16 or fp32, or drop --cast-optim",
    ),
    Rule(
        "--cast-optim",
        lambda c: c.cast_optim,
        _holds_optimizer,
        "applies to optimizer state, and this output holds none (--only model, or --format hf)",
        "drop --cast-optim",
    ),
    Rule(
        "--optim-keys",
        lambda c: c.optim_keys != "keep",
        _holds_optimizer,
        "applies to optimizer state, and this output holds none (--only model, or --format hf)",
        "drop --optim-keys",
    ),
    Rule(
        "--optim-keys",
        lambda c: c.optim_keys in ("fqn", "id"),
        lambda c: c.fmt != "torchtitan",
        "cannot nest the optimizer of --format torchtitan, which loads it flattened",
        "drop --optim-keys, or pass --optim-keys flat",
    ),
    Rule(
        "--dtype",
        lambda c: c.dtype != "keep",
        lambda c: c.only != "optim" or c.cast_optim,
        "casts model tensors, and --only optim writes none",
        "add --cast-optim to cast optimizer state, or drop --dtype",
    ),
    Rule(
        "--nest",
        lambda c: c.nest is not None,
        lambda c: c.fmt != "hf",
        "has nothing to act on in --format hf, which names tensors by their FQN alone",
        "drop --nest",
    ),
    Rule(
        "--src-local",
        lambda c: c.src_local,
        lambda c: c.distributed,
        "applies under torchrun, where ranks on several nodes read SRC",
        "drop --src-local, or launch with torchrun",
    ),
)

INSPECT_RULES: tuple[Rule, ...] = (
    _WRAP_NEEDS_MODEL,
    Rule(
        "--model",
        lambda c: c.model is not None,
        _may_be_fsdp1_local_source,
        "applies to fsdp1-local and veRL sources only (it names what their flat parameters hold)",
        "drop --model (and --wrap)",
    ),
)


_JSON_NOT_QUIET = Rule(
    "--json",
    lambda c: c.json_out,
    lambda c: not c.quiet,
    "has nothing to print under --quiet, which prints nothing",
    "drop one of them",
)
DIFF_RULES: tuple[Rule, ...] = (_JSON_NOT_QUIET,)
VERIFY_RULES: tuple[Rule, ...] = (_JSON_NOT_QUIET,)


def check(rules: tuple[Rule, ...], choice: Choice) -> None:
    """Raise a usage error for the first option in ``rules`` given where it does not apply."""
    for rule in rules:
        if rule.given(choice) and not rule.applies(choice):
            raise UsageError(f"{rule.option} {rule.why}", hint=rule.hint)
