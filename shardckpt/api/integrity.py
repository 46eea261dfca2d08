"""``verify``: every byte of a checkpoint read once and checked against what was written with it.

Call order (every rank makes every call, with the same request):
  1) (an agreed step) open SRC as ``inspect`` does, which runs every check of its
     metadata (DCP's chunks tile each tensor, per-rank files are one save, a
     safetensors header reads), and work out what each file's layout says
     (``formats.file_checks``);
  2) (an agreed step) each rank reads its share of the files (``engine.scan``), CRC'ing
     every span that carries a checksum as it passes;
  3) (collective) the coordinator judges every rank's spans (``engine.read_checks``).
Damage is a finding, not an error: every damaged tensor and file is listed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from shardckpt.api import applies
from shardckpt.api.requests import VerifyRequest
from shardckpt.api.source import open_checked
from shardckpt.api.storage import named, on_storage
from shardckpt.core.dist import Runtime
from shardckpt.core.errors import source_option
from shardckpt.core.progress import Progress
from shardckpt.engine.read_checks import judged
from shardckpt.engine.scan import scan
from shardckpt.formats.file_checks import FileCheck, file_checks
from shardckpt.state.checksums import Ledger, Verdict, checking


@dataclass(frozen=True)
class Finding:
    """One thing found damaged: the file, the tensors it concerns, and what is wrong."""

    file: str
    message: str
    tensors: tuple[str, ...] = ()
    where: str | None = None
    """The record or bytes concerned, when it is a checksum that does not match."""


@dataclass
class Integrity:
    """What ``verify`` found: what was read and checked, and every finding."""

    src: str
    format: str
    world_size: int | None
    files: int
    bytes: int
    checked: int
    """Records and tensors whose bytes were checked against a checksum."""
    checked_bytes: int
    seconds: float = 0.0
    """The whole run, SRC's metadata checks included."""
    read_seconds: float = 0.0
    """Reading the files and CRC'ing them, on the slowest rank."""
    damaged: list[Finding] = field(default_factory=list)

    @property
    def intact(self) -> bool:
        """Return whether nothing was found damaged."""
        return not self.damaged

    @property
    def unchecked_bytes(self) -> int:
        """Return the bytes read that carry no checksum (headers, pickles of other formats, .metadata)."""
        return self.bytes - self.checked_bytes


@source_option("--from")
def verify(
    request: VerifyRequest, runtime: Runtime | None = None, progress: Progress | None = None
) -> Integrity:
    """Return what reading every byte of ``request.src`` found; a damaged checkpoint is findings, not an error."""
    runtime = runtime or Runtime()
    with on_storage(request, runtime) as run:
        return named(_verify(run.request, runtime, progress or Progress()), run)


def _verify(request: VerifyRequest, runtime: Runtime, progress: Progress) -> Integrity:
    request.check()
    start = time.perf_counter()
    with checking(always=True) as ledger:

        def opened() -> tuple[str, int | None, list[FileCheck]]:
            reader = open_checked(
                request.src,
                request.format,
                applies.VERIFY_RULES,
                applies.Choice(src_format=request.format),
                trust_pickle=request.trust_pickle,
            )
            index = reader.index()
            return reader.format, index.world_size, file_checks(reader, index, ledger)

        fmt, world_size, checks = runtime.agreed(opened)
        _expect(ledger, checks)
        total = sum(c.size for c in checks)
        progress.begin(total, "read")
        reading = time.perf_counter()
        try:
            runtime.agreed(
                lambda: scan(
                    checks,
                    ledger,
                    runtime.rank,
                    runtime.world_size,
                    _scaled(progress, runtime),
                    request.threads,
                )
            )
        finally:
            progress.close()
        read_seconds = time.perf_counter() - reading
        verdict = judged(runtime)
    assert verdict is not None  # checking(always=True) is active
    result = Integrity(
        str(request.src), fmt, world_size, len(checks), total, verdict.whole, verdict.bytes
    )
    result.damaged = _findings(checks, verdict)
    result.seconds = time.perf_counter() - start
    result.read_seconds = read_seconds
    return result


def _expect(ledger: Ledger, checks: list[FileCheck]) -> None:
    """Tell the ledger every span that carries a checksum, with the tensors it holds."""
    for check in checks:
        for span, names in zip(check.spans, check.names):
            ledger.expect(span, names)


def _scaled(progress: Progress, runtime: Runtime):
    """Return a progress callback that counts this rank's bytes for every rank (each reads about as much)."""
    return lambda n: progress(n * runtime.world_size)


def _findings(checks: list[FileCheck], verdict: Verdict) -> list[Finding]:
    """Return every finding in file order: what the layouts show wrong, then each checksum that does not match."""
    found = [Finding(c.path, problem) for c in checks for problem in c.problems]
    for damage in verdict.damaged:
        written = damage.written
        found.append(Finding(written.file, damage.message(), damage.names, written.where))
    order = {c.path: i for i, c in enumerate(checks)}
    return sorted(found, key=lambda f: order.get(f.file, len(order)))
