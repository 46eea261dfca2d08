"""Benchmark `shardckpt convert --to full` against torch's dcp_to_torch_save and `cp -r`.

    python scripts/bench.py [--size-gb 1.0] [--workdir .bench] [--keep] [--warmup]
                            [--repeat N] [--json]

Builds (or reuses) an FSDP2 DCP checkpoint of about SIZE_GB in WORKDIR, then runs
each case as its own process and reports wall time, throughput (source bytes / wall)
and peak RSS. Peak RSS is the largest resident set of any single process in the case:
the rusage that wait4() returns for a child also covers every descendant it waited
for, so for torchrun it is the max over the agent and its workers.

The source is read from the page cache (it was just written, or read by the previous
case), so the numbers measure conversion work rather than cold-disk reads.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
ROOT = SCRIPTS.parent
NPROC = 2
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
# torchrun sets OMP_NUM_THREADS=1 for its workers anyway, with a banner on stderr;
# setting it ourselves for torchrun cases only silences the banner.
TORCHRUN_ENV = {"OMP_NUM_THREADS": "1"}
DCP_TO_TORCH_SAVE = (
    "import sys\n"
    "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
    "dcp_to_torch_save(sys.argv[1], sys.argv[2])\n"
)


@dataclass(kw_only=True, slots=True)
class Case:
    """One benchmarked command."""

    name: str
    """Row label in the table."""
    argv: list[str]
    """The command, run from the repository root."""
    dst: Path
    """What the command writes; removed before and after the case."""
    env: dict[str, str] = field(default_factory=dict)
    """Variables added to the inherited environment."""


@dataclass(kw_only=True, slots=True)
class Result:
    """What one timed run of a case measured."""

    case: str
    returncode: int
    wall_s: float
    """Wall-clock seconds from spawning the process to reaping it."""
    gb_per_s: float
    """Source bytes (1 GB = 1e9 bytes) over wall_s."""
    peak_rss_gib: float
    """Largest resident set of any one process of the case."""
    dst_bytes: int
    """Size of what the case wrote: a sanity check that it wrote the whole thing."""
    walls_s: list[float] = field(default_factory=list)
    """Every timed run's wall_s, when --repeat asked for several."""
    vs_dcp_to_torch_save: float | None = None
    """wall_s over dcp_to_torch_save's (None if that case failed)."""
    vs_copy: float | None = None
    """wall_s over `cp -r`'s (None if that case failed)."""


def tree_bytes(path: Path) -> int:
    """Return the total size of the files under path (or of path itself)."""
    if path.is_file():
        return path.stat().st_size
    if not path.exists():
        return 0
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def remove(path: Path) -> None:
    """Delete a file or directory tree if it exists."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def cleanup(src: Path, workdir: Path) -> None:
    """Delete the source checkpoint, and workdir if that leaves it empty."""
    # Only what this script wrote: --workdir may name a directory holding other things.
    remove(src)
    remove(src.with_name(src.name + ".partial"))
    try:
        workdir.rmdir()
    except OSError:
        pass


def shardckpt_argv() -> list[str]:
    """Return the shardckpt console script that belongs to this interpreter's env."""
    beside = Path(sys.executable).parent / "shardckpt"
    found = str(beside) if beside.exists() else shutil.which("shardckpt")
    return [found or "shardckpt"]


def ensure_source(workdir: Path, size_gb: float) -> Path:
    """Return a DCP checkpoint of size_gb in workdir, building it if it is not there."""
    src = workdir / f"dcp-{size_gb:g}gb"
    if (src / ".metadata").is_file():
        log(f"reusing {src}")
        return src
    workdir.mkdir(parents=True, exist_ok=True)
    log(f"building {src} with {NPROC} ranks ...")
    argv = [*TORCHRUN, f"--nproc-per-node={NPROC}", str(SCRIPTS / "bench_make_ckpt.py")]
    env = {**os.environ, **TORCHRUN_ENV}
    # stdout is kept for the table or JSON document.
    subprocess.run(
        [*argv, str(src), f"--size-gb={size_gb}"], cwd=ROOT, env=env, stdout=sys.stderr, check=True
    )
    return src


def cases(src: Path, workdir: Path) -> list[Case]:
    """Return the benchmarked commands, in the order they run."""
    convert = ["convert", str(src)]
    flags = ["--to", "full", "--overwrite", "--quiet"]
    out = {key: workdir / f"out-{key}.pt" for key in ("n1", "n2", "torch")}
    copy = workdir / "copy"
    return [
        Case(
            name="shardckpt convert --to full (N=1)",
            argv=[*shardckpt_argv(), *convert, str(out["n1"]), *flags],
            dst=out["n1"],
        ),
        Case(
            name=f"torchrun -m shardckpt convert --to full (N={NPROC})",
            argv=[
                *TORCHRUN,
                f"--nproc-per-node={NPROC}",
                "-m",
                "shardckpt",
                *convert,
                str(out["n2"]),
                *flags,
            ],
            dst=out["n2"],
            env=TORCHRUN_ENV,
        ),
        Case(
            name="dcp_to_torch_save",
            argv=[sys.executable, "-c", DCP_TO_TORCH_SAVE, str(src), str(out["torch"])],
            dst=out["torch"],
        ),
        Case(name="cp -r", argv=["cp", "-r", str(src), str(copy)], dst=copy),
    ]


def measure(case: Case, src_bytes: int) -> Result:
    """Run case once in a fresh process and return its wall time and peak RSS."""
    remove(case.dst)
    start = time.perf_counter()
    try:
        proc = subprocess.Popen(
            case.argv, cwd=ROOT, env={**os.environ, **case.env}, stdout=subprocess.DEVNULL
        )
    except FileNotFoundError as e:
        # Reported as a failed row (127, as a shell would), so the other cases still run.
        log(f"cannot run {case.name}: {e}")
        return Result(
            case=case.name, returncode=127, wall_s=0.0, gb_per_s=0.0, peak_rss_gib=0.0, dst_bytes=0
        )
    # wait4 rather than proc.wait(): its rusage is this child's (and its descendants'),
    # where RUSAGE_CHILDREN would mix in every case run before.
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    dst_bytes = tree_bytes(case.dst)
    remove(case.dst)
    return Result(
        case=case.name,
        returncode=proc.returncode,
        wall_s=wall,
        gb_per_s=src_bytes / 1e9 / wall,
        # Linux reports ru_maxrss in KiB.
        peak_rss_gib=usage.ru_maxrss / 2**20,
        dst_bytes=dst_bytes,
    )


def best(runs: list[Result]) -> Result:
    """Return the fastest run, or the first failed one; peak RSS is the max over all."""
    failed = [r for r in runs if r.returncode != 0]
    # The fastest run is the one least disturbed by other load on the machine; memory
    # is not disturbed that way, so the worst case is the honest one.
    chosen = failed[0] if failed else min(runs, key=lambda r: r.wall_s)
    chosen.peak_rss_gib = max(r.peak_rss_gib for r in runs)
    chosen.walls_s = [r.wall_s for r in runs]
    return chosen


def add_ratios(results: list[Result]) -> None:
    """Fill in each result's wall time relative to dcp_to_torch_save and to cp -r."""
    walls = {r.case: r.wall_s for r in results if r.returncode == 0}
    torch_wall, copy_wall = walls.get("dcp_to_torch_save"), walls.get("cp -r")
    for r in results:
        if r.returncode != 0:
            continue
        r.vs_dcp_to_torch_save = r.wall_s / torch_wall if torch_wall else None
        r.vs_copy = r.wall_s / copy_wall if copy_wall else None


def table(results: list[Result]) -> str:
    """Return the results as a Markdown table."""

    def ratio(value: float | None) -> str:
        return "–" if value is None else f"{value:.2f}x"

    lines = [
        "| case | wall s | GB/s | peak RSS GiB | vs dcp_to_torch_save | vs cp -r |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if r.returncode != 0:
            lines.append(f"| {r.case} | failed (exit {r.returncode}) | | | | |")
            continue
        lines.append(
            f"| {r.case} | {r.wall_s:.2f} | {r.gb_per_s:.2f} | {r.peak_rss_gib:.2f} "
            f"| {ratio(r.vs_dcp_to_torch_save)} | {ratio(r.vs_copy)} |"
        )
    return "\n".join(lines)


def environment() -> dict[str, object]:
    """Return what the numbers depend on besides the code."""
    torch_version = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.__version__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return {
        "python": platform.python_version(),
        "torch": torch_version,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
    }


def log(message: str) -> None:
    """Print a progress line to stderr, keeping stdout for the table or JSON."""
    print(f"bench: {message}", file=sys.stderr, flush=True)


def parse_args() -> argparse.Namespace:
    """Return the command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.0, help="model + AdamW state, GB")
    parser.add_argument("--workdir", type=Path, default=ROOT / ".bench")
    parser.add_argument(
        "--keep", action="store_true", help="keep the source checkpoint for the next run"
    )
    parser.add_argument("--warmup", action="store_true", help="run each case once untimed")
    parser.add_argument(
        "--repeat", type=int, default=1, help="timed runs per case; the fastest is reported"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args()
    if args.size_gb <= 0:
        parser.error(f"--size-gb must be positive, got {args.size_gb}")
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, got {args.repeat}")
    return args


def main() -> int:
    """Run the benchmark; return 0 when every case succeeded, else 1."""
    args = parse_args()
    workdir = args.workdir.resolve()
    try:
        src = ensure_source(workdir, args.size_gb)
    except subprocess.CalledProcessError as e:
        log(f"building the source checkpoint failed (exit {e.returncode}); output above")
        return 1
    src_bytes = tree_bytes(src)
    log(f"source: {src} ({src_bytes / 1e9:.3f} GB)")

    results = []
    try:
        for case in cases(src, workdir):
            if args.warmup:
                log(f"warm-up: {case.name}")
                measure(case, src_bytes)
            runs = []
            for i in range(args.repeat):
                log(f"timing ({i + 1}/{args.repeat}): {case.name}")
                runs.append(measure(case, src_bytes))
            results.append(best(runs))
    finally:
        if not args.keep:
            cleanup(src, workdir)
    add_ratios(results)

    if args.json:
        doc = {
            "src": str(src),
            "src_bytes": src_bytes,
            "nproc": NPROC,
            "environment": environment(),
            "results": [asdict(r) for r in results],
        }
        print(json.dumps(doc, indent=2))
    else:
        env = environment()
        print(
            f"source: {src_bytes / 1e9:.3f} GB FSDP2 DCP checkpoint (model + AdamW, fp32); "
            f"torch {env['torch']}, {env['cpus']} CPUs; best of {args.repeat}\n"
        )
        print(table(results))
    return 0 if all(r.returncode == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
