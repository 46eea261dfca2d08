"""Benchmark what checking checksums costs: a full export with the read-time checks on and off,
and `shardckpt verify` against `cat` of the same files.

    python scripts/bench_integrity.py [--size-gb 1.0] [--repeat 3] [--nproc 1,2] [--workdir .bench]
                                      [--keep] [--json]

Builds (or reuses) the FSDP2 DCP checkpoint of ``scripts/bench.py`` (``--keep`` keeps it),
then, in one run, alternating so that load on the machine falls on both alike:

- ``shardckpt convert SRC out.pt --to full`` with the checks on, and with
  ``SHARDCKPT_CHECKSUMS=0``; the cost is the ratio of the fastest runs of each;
- ``cat SRC/* > /dev/null`` and ``shardckpt verify SRC --json`` (standalone, and under
  torchrun for each N of ``--nproc`` above 1); verify's speed is cat's time over its own,
  for the whole command and for the reading itself (``read_seconds``: reading and CRC'ing,
  without starting Python, importing torch and checking SRC's metadata).

Wall times and the CPU time (user + sys) of each command's process tree are reported:
on a machine others load too, CPU time shows the work where wall time shows the wait.

The source is read from the page cache (it was just written or read), so the figures
measure the work rather than the disk. One Markdown table on stdout (or JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import (
    TORCHRUN,
    TORCHRUN_ENV,
    cleanup,
    ensure_source,
    environment,
    remove,
    shardckpt_argv,
    tree_bytes,
)

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Row:
    """One measured command: best and median wall time, median CPU time (user + sys), a ratio."""

    case: str
    best_s: float
    median_s: float
    cpu_s: float
    ratio: str = ""
    note: str = ""


@dataclass
class Run:
    """One run of a command: wall time, CPU time of the process tree, stdout."""

    wall: float
    cpu: float
    out: str


def timed(argv: list[str], env: dict[str, str] | None = None, stdout=subprocess.DEVNULL) -> Run:
    """Run argv from the repository root; return its times and stdout (a failure stops the benchmark)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(
        argv,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(
            f"bench: {' '.join(argv)} failed (exit {done.returncode}):\n{done.stderr[-2000:]}"
        )
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Run(wall, cpu, done.stdout or "")


def best(values: list[float]) -> float:
    """Return the smallest of ``values``."""
    return min(values)


def median(values: list[float]) -> float:
    """Return the median of ``values`` (the upper one of an even count)."""
    return sorted(values)[len(values) // 2]


def row(case: str, runs: list[Run], ratio: str = "", note: str = "") -> Row:
    """Return the row of ``runs`` of one command."""
    walls = [r.wall for r in runs]
    return Row(case, best(walls), median(walls), median([r.cpu for r in runs]), ratio, note)


def crc_cost(src: Path, workdir: Path, repeat: int) -> list[Row]:
    """Return the full export's times with the read-time checks on and off (alternated)."""
    dst = workdir / "out.pt"
    argv = [*shardckpt_argv(), "convert", str(src), str(dst), "--to", "full", "--overwrite", "-q"]
    runs: dict[str, list[Run]] = {"on": [], "off": []}
    for _ in range(repeat):
        for mode, env in (("off", {"SHARDCKPT_CHECKSUMS": "0"}), ("on", {})):
            runs[mode].append(timed(argv, env))
            remove(dst)
    off = row("convert --to full, checks off (SHARDCKPT_CHECKSUMS=0)", runs["off"])
    on = row("convert --to full, checks on (default)", runs["on"])
    on.ratio = f"{on.best_s / off.best_s:.3f}x off (wall)"
    on.note = (
        f"wall {100 * (on.best_s / off.best_s - 1):+.1f}% (best), "
        f"{100 * (on.median_s / off.median_s - 1):+.1f}% (median); "
        f"CPU {100 * (on.cpu_s / off.cpu_s - 1):+.1f}% (median)"
    )
    return [off, on]


def verify_speed(src: Path, nprocs: list[int], repeat: int) -> list[Row]:
    """Return cat's and verify's times on the same files (alternated), and verify's speed as a fraction of cat's."""
    files = sorted(str(p) for p in src.rglob("*") if p.is_file())
    cat = ["sh", "-c", 'cat "$@" > /dev/null', "cat", *files]
    cats: list[Run] = []
    verifies: dict[int, list[Run]] = {n: [] for n in nprocs}
    reading: dict[int, list[float]] = {n: [] for n in nprocs}
    for _ in range(repeat):
        cats.append(timed(cat))
        for n in nprocs:
            command = ["verify", str(src), "--json"]
            if n == 1:
                argv, env = [*shardckpt_argv(), *command], None
            else:
                argv = [*TORCHRUN, f"--nproc-per-node={n}", "-m", "shardckpt", *command]
                env = TORCHRUN_ENV
            run = timed(argv, env, stdout=subprocess.PIPE)
            doc = json.loads(run.out)
            if not doc["intact"]:
                raise SystemExit(f"bench: verify found {src} damaged: {doc['damaged'][:3]}")
            verifies[n].append(run)
            reading[n].append(doc["read_seconds"])
    cat_row = row("cat SRC/* > /dev/null", cats)
    gib = tree_bytes(src) / 2**30
    cat_row.note = f"{gib / cat_row.best_s:.2f} GiB/s"
    rows = [cat_row]
    for n in nprocs:
        r = row(f"shardckpt verify SRC (N={n})", verifies[n])
        read = best(reading[n])
        r.ratio = f"{cat_row.best_s / r.best_s:.2f}x cat (whole command)"
        r.note = (
            f"reading and CRC'ing alone (read_seconds) {read:.2f} s: {gib / read:.2f} GiB/s, "
            f"{cat_row.best_s / read:.2f}x cat's speed"
        )
        rows.append(r)
    return rows


def table(rows: list[Row]) -> str:
    """Return the rows as a Markdown table."""
    lines = [
        "| case | best wall s | median wall s | median CPU s | ratio | note |",
        "|---|---:|---:|---:|---|---|",
    ]
    lines += [
        f"| {r.case} | {r.best_s:.2f} | {r.median_s:.2f} | {r.cpu_s:.2f} | {r.ratio} | {r.note} |"
        for r in rows
    ]
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    """Return the command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size-gb", type=float, default=1.0, help="model + AdamW state, GB (default 1.0)"
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs of each command (default 3)")
    parser.add_argument("--nproc", default="1,2", help="launch sizes of verify (default 1,2)")
    parser.add_argument("--workdir", type=Path, default=ROOT / ".bench")
    parser.add_argument("--keep", action="store_true", help="keep the source for the next run")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args()
    args.nprocs = [int(n) for n in args.nproc.split(",")]
    if args.repeat < 1 or min(args.nprocs) < 1:
        parser.error("--repeat and every --nproc must be at least 1")
    return args


def main() -> int:
    """Run the benchmark; print the table (or JSON); return 0."""
    args = parse_args()
    workdir = args.workdir.resolve()
    src = ensure_source(workdir, args.size_gb)
    src_bytes = tree_bytes(src)
    load = os.getloadavg()
    try:
        rows = crc_cost(src, workdir, args.repeat) + verify_speed(src, args.nprocs, args.repeat)
    finally:
        cleanup([workdir / "out.pt", *([] if args.keep else [src])], workdir)
    after = os.getloadavg()
    doc = {
        "environment": environment(),
        "source": {"path": str(src), "bytes": src_bytes},
        "load_average": {"before": load, "after": after},
        "repeat": args.repeat,
        "rows": [asdict(r) for r in rows],
    }
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(
            f"- source: {doc['source']['bytes']} bytes; load average before {load[0]:.2f}, after {after[0]:.2f}"
        )
        print(f"- best and median of {args.repeat} runs each, alternated\n")
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
