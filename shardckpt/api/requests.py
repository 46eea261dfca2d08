"""What each command is asked to do: one frozen, keyword-only request per command.

The CLI builds a request from its options; a library user builds one directly and
passes it to ``shardckpt.api.inspect``, ``convert``, ``diff`` or ``verify``. A request holds the
user's words as given (paths, names, globs), normalised to immutable values; what
they mean is checked when the command runs (``ConvertRequest.check``), on every rank
alike, inside the first agreed step.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from shardckpt.core.errors import UsageError
from shardckpt.state.choices import DEFAULT_BUFFER_BYTES, LAYOUTS


def _frozen(request: object) -> None:
    """Turn every list field of ``request`` into a tuple, so a request cannot change after it is made."""
    for f in fields(request):  # type: ignore[arg-type]
        value = getattr(request, f.name)
        if isinstance(value, list):
            object.__setattr__(request, f.name, tuple(value))


@dataclass(frozen=True, kw_only=True, slots=True)
class InspectRequest:
    """``shardckpt inspect SRC``: what a checkpoint holds, from its metadata."""

    src: str | os.PathLike
    """The checkpoint: a file or a directory."""
    format: str | None = None
    """The source's format; None detects it."""
    filters: Sequence[str] = ()
    """Globs over dotted paths: only leaves that match one are listed (all when empty)."""
    trust_pickle: bool = False
    """Load pickles that may run code (only for files you trust)."""
    model: str | None = None
    """``pkg.module:factory`` building the model: what an ``fsdp1-local`` source's flat parameters hold."""
    wraps: Sequence[str] = ()
    """FSDP1 ``ModuleWrapPolicy`` classes (``pkg.module:Class``), with ``model``."""
    verify: bool = False
    """Also read every byte and check it against its checksums, as ``verify`` does."""
    storage_options: Sequence[str] = ()
    """``KEY=VALUE`` options of the filesystem behind a URL SRC or DST (``--storage-option``)."""

    def __post_init__(self) -> None:
        _frozen(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class ConvertRequest:
    """``shardckpt convert SRC DST --to LAYOUT``: another layout, format or world size, exactly."""

    src: str | os.PathLike
    """The source checkpoint."""
    dst: str | os.PathLike
    """Where the output goes; written beside it and renamed when complete."""
    to: str
    """The output's layout: ``full``, ``sharded`` or ``local``."""
    format: str | None = None
    """The output's format; None writes the layout's default (by DST's suffix for ``full``)."""
    src_format: str | None = None
    """The source's format; None detects it."""
    world_size: int | None = None
    """The ranks DST is for (sharded and local layouts); None takes the launch's."""
    only: str = "all"
    """``all``, ``model`` or ``optim``: which part of the tree to write."""
    filters: Sequence[str] = ()
    """Globs over dotted paths: only matching leaves are written (all when empty)."""
    clean_fqns: bool = True
    """Strip FSDP/activation-checkpointing/compile wrappers and DDP's ``module.`` from FQNs."""
    dtype: str = "keep"
    """Cast model floating tensors: ``keep``, ``bf16``, ``fp16`` or ``fp32``."""
    cast_optim: bool = False
    """Cast optimizer state too, with ``dtype``."""
    max_shard_size: int | None = None
    """Bytes per safetensors shard of an ``hf`` output."""
    optim_keys: str = "keep"
    """Key optimizer state by ``fqn``, ``id`` or ``flat`` (torch's flattened form), or ``keep``."""
    edits: Sequence[tuple[str, str]] = ()
    """``("--rename", "REGEX=REPL")`` and ``("--drop", "REGEX")`` pairs, applied to every FQN in order."""
    unnest: str | None = None
    """Write the subtree under this top-level key as the whole tree."""
    nest: str | None = None
    """Write the tree under this top-level key."""
    model: str | None = None
    """``pkg.module:factory`` building the model (param-ID order, groups, FSDP1 layouts)."""
    wraps: Sequence[str] = ()
    """FSDP1 ``ModuleWrapPolicy`` classes (``pkg.module:Class``), with ``model``."""
    use_orig_params: bool = False
    """An ``fsdp1-local`` output for a job run with ``use_orig_params=True``."""
    zero_stage: int | None = None
    """A ``deepspeed`` output's ZeRO stage (1, 2 or 3); None: SRC's."""
    overwrite: bool = False
    """Replace an existing DST that holds a checkpoint."""
    dry_run: bool = False
    """Plan only: check everything and say what would be written; write nothing."""
    verify: bool = False
    """Read the output back and compare it with SRC before it becomes DST."""
    trust_pickle: bool = False
    """Load pickles that may run code (only for files you trust)."""
    buffer_bytes: int = DEFAULT_BUFFER_BYTES
    """The most tensor bytes one process holds at a time."""
    src_local: bool = False
    """Under torchrun: SRC lies on the nodes' own disks (silences the note that says so)."""
    hf_config: str | os.PathLike | None = None
    """A directory whose ``config.json`` and companions an ``hf`` output gets."""
    storage_options: Sequence[str] = ()
    """``KEY=VALUE`` options of the filesystem behind a URL SRC or DST (``--storage-option``)."""
    map: str | None = None
    """An architecture mapping (``plan.mapping``): a shipped one's name or a ``.toml`` file;
    None: chosen for an ``hf`` output from SRC's format and the config's ``architectures``."""
    threads: int | None = None
    """Worker threads that move the bytes in each process; None: the cores it may use
    (shared by the ranks on a node under torchrun)."""

    def __post_init__(self) -> None:
        _frozen(self)
        object.__setattr__(self, "edits", tuple(tuple(e) for e in self.edits))

    def check(self) -> None:
        """Raise a usage error for what the request asks that no run could do (pure, no I/O)."""
        if self.to not in LAYOUTS:
            raise UsageError(f"--to must be one of {', '.join(LAYOUTS)}, not {self.to!r}")
        if self.world_size is not None and self.world_size < 1:
            raise UsageError(
                f"--world-size must be at least 1, not {self.world_size}",
                hint="pass the number of ranks that will load the output",
            )
        _check_buffer(self.buffer_bytes)
        _check_threads(self.threads)
        if self.max_shard_size is not None and self.max_shard_size <= 0:
            raise UsageError("--max-shard-size must be positive", hint="write it like 5GB or 500MB")
        if self.zero_stage is not None and self.zero_stage not in (1, 2, 3):
            raise UsageError(
                f"--zero-stage must be 1, 2 or 3, not {self.zero_stage}",
                hint="DeepSpeed's ZeRO stages with an optimizer partitioned over the ranks",
            )

    @property
    def src_path(self) -> Path:
        """Return SRC as a path."""
        return Path(self.src)


@dataclass(frozen=True, kw_only=True, slots=True)
class DiffRequest:
    """``shardckpt diff A B``: whether two checkpoints of any formats hold the same, leaf by leaf."""

    a: str | os.PathLike
    """The first checkpoint."""
    b: str | os.PathLike
    """The second checkpoint."""
    format_a: str | None = None
    """A's format; None detects it."""
    format_b: str | None = None
    """B's format; None detects it."""
    atol: float = 0.0
    """Absolute tolerance (0: bit for bit)."""
    rtol: float = 0.0
    """Relative tolerance (0: bit for bit)."""
    clean_fqns: bool = True
    """Compare FQNs after the same cleaning ``convert`` does."""
    only: str = "all"
    """``all``, ``model`` or ``optim``: which part of both trees to compare."""
    filters: Sequence[str] = ()
    """Globs over dotted paths: only matching leaves are compared (all when empty)."""
    cast: bool = False
    """Compare floating tensors of different dtypes in the wider one."""
    unnest_a: str | None = None
    """Compare A's subtree under this top-level key as A's whole tree."""
    nest_a: str | None = None
    """Compare A's tree as if it were under this top-level key."""
    unnest_b: str | None = None
    """As ``unnest_a``, for B."""
    nest_b: str | None = None
    """As ``nest_a``, for B."""
    trust_pickle: bool = False
    """Load pickles that may run code (only for files you trust)."""
    buffer_bytes: int = DEFAULT_BUFFER_BYTES
    """The most tensor bytes one process holds at a time, both sides' batches together."""
    storage_options: Sequence[str] = ()
    """``KEY=VALUE`` options of the filesystem behind a URL SRC or DST (``--storage-option``)."""

    def __post_init__(self) -> None:
        _frozen(self)

    def check(self) -> None:
        """Raise a usage error for a tolerance that is not a finite number >= 0, or no buffer (pure)."""
        for name, tol in (("--atol", self.atol), ("--rtol", self.rtol)):
            if not (tol >= 0 and math.isfinite(tol)):
                raise UsageError(f"{name} must be a finite number >= 0, not {tol}")
        _check_buffer(self.buffer_bytes)


@dataclass(frozen=True, kw_only=True, slots=True)
class VerifyRequest:
    """``shardckpt verify SRC``: whether every byte of a checkpoint is as it was written."""

    src: str | os.PathLike
    """The checkpoint: a file or a directory."""
    format: str | None = None
    """The source's format; None detects it."""
    trust_pickle: bool = False
    """Load pickles that may run code (only for files you trust)."""
    storage_options: Sequence[str] = ()
    """``KEY=VALUE`` options of the filesystem behind a URL SRC or DST (``--storage-option``)."""
    threads: int | None = None
    """Threads that read and checksum in each process; None: as ``ConvertRequest.threads``."""

    def check(self) -> None:
        """Raise a usage error for a thread count below 1 (pure)."""
        _check_threads(self.threads)


def _check_threads(threads: int | None) -> None:
    """Raise a usage error for a ``--threads`` below 1."""
    if threads is not None and threads < 1:
        raise UsageError(
            f"--threads must be at least 1, not {threads}",
            hint="leave it out to use every core the process may run on",
        )


def _check_buffer(buffer_bytes: int) -> None:
    """Raise a usage error for a ``--buffer-size`` that is not positive."""
    if buffer_bytes <= 0:
        raise UsageError("--buffer-size must be positive")
