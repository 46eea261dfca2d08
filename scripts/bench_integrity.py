"""Benchmark what checking checksums costs: a full export with the read-time checks on and off,
and `shardckpt verify` against `cat` of the same files.

    python scripts/bench_integrity.py [--size-gb 1.0] [--repeat 3] [--nproc 1,2] [--workdir .bench]
                                      [--keep] [--json]

Builds (or reuses) the FSDP2 DCP checkpoint of ``scripts/bench.py`` (``--keep`` keeps it),
then, in one run, alternating so that load on the machine falls on both alike:

- ``shardckpt convert SRC out.pt --to full`` with the checks on, and with
  ``SHARDCKPT_CHECKSUMS=0``; the cost is the ratio of the fastest runs of each;
- ``cat SRC/* > /dev/null`` and ``shardckpt verify SRC -q`` (standalone, and under torchrun
  for each N of ``--nproc`` above 1); verify's speed is cat's time over its own, for the
  whole command and for the checking itself (``verify --json``'s ``seconds``, which
  leaves out starting Python and importing torch).

The source is read from the page cache (it was just written or read), so the figures
measure the work rather than the disk. One Markdown table on stdout (or JSON).
"""

from __future__ import annotations

import argparse
import json
import os
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
    """One measured command: its label, best and median wall time over the repeats, and a ratio."""

    case: str
    best_s: float
    median_s: float
    ratio: str = ""
    note: str = ""


def timed(
    argv: list[str], env: dict[str, str] | None = None, stdout=subprocess.DEVNULL
) -> tuple[float, str]:
    """Run argv from the repository root; return its wall time and stdout (a failure stops the benchmark)."""
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
    if done.returncode != 0:
        raise SystemExit(
            f"bench: {' '.join(argv)} failed (exit {done.returncode}):\n{done.stderr[-2000:]}"
        )
    return wall, done.stdout or ""


def summary(times: list[float]) -> tuple[float, float]:
    """Return the best and the median of ``times``."""
    ordered = sorted(times)
    return ordered[0], ordered[len(ordered) // 2]


def crc_cost(src: Path, workdir: Path, repeat: int) -> list[Row]:
    """Return the full export's wall time with the read-time checks on and off (alternated)."""
    dst = workdir / "out.pt"
    argv = [*shardckpt_argv(), "convert", str(src), str(dst), "--to", "full", "--overwrite", "-q"]
    times: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(repeat):
        for mode, env in (("off", {"SHARDCKPT_CHECKSUMS": "0"}), ("on", {})):
            times[mode].append(timed(argv, env)[0])
            remove(dst)
    on, off = summary(times["on"]), summary(times["off"])
    return [
        Row("convert --to full, checks off (SHARDCKPT_CHECKSUMS=0)", *off),
        Row(
            "convert --to full, checks on (default)",
            *on,
            ratio=f"{on[0] / off[0]:.3f}x off",
            note=f"cost {100 * (on[0] / off[0] - 1):+.1f}% (best), "
            f"{100 * (on[1] / off[1] - 1):+.1f}% (median)",
        ),
    ]


def verify_speed(src: Path, nprocs: list[int], repeat: int) -> list[Row]:
    """Return cat's and verify's times on the same files (alternated), and verify's speed as a fraction of cat's."""
    files = sorted(str(p) for p in src.rglob("*") if p.is_file())
    cat = ["sh", "-c", 'cat "$@" > /dev/null', "cat", *files]
    runs = {"cat": []}
    checking: dict[int, list[float]] = {}
    for n in nprocs:
        runs[f"verify N={n}"] = []
        checking[n] = []
    for _ in range(repeat):
        runs["cat"].append(timed(cat)[0])
        for n in nprocs:
            command = ["verify", str(src), "--json"]
            if n == 1:
                argv, env = [*shardckpt_argv(), *command], None
            else:
                argv = [*TORCHRUN, f"--nproc-per-node={n}", "-m", "shardckpt", *command]
                env = TORCHRUN_ENV
            wall, out = timed(argv, env, stdout=subprocess.PIPE)
            doc = json.loads(out)
            if not doc["intact"]:
                raise SystemExit(f"bench: verify found {src} damaged: {doc['damaged'][:3]}")
            runs[f"verify N={n}"].append(wall)
            checking[n].append(doc["seconds"])
    cat_best, cat_median = summary(runs["cat"])
    gib = tree_bytes(src) / 2**30
    rows = [Row("cat SRC/* > /dev/null", cat_best, cat_median, note=f"{gib / cat_best:.2f} GiB/s")]
    for n in nprocs:
        best, median = summary(runs[f"verify N={n}"])
        inner, _ = summary(checking[n])
        rows.append(
            Row(
                f"shardckpt verify SRC (N={n})",
                best,
                median,
                ratio=f"{cat_best / best:.2f}x cat's speed",
                note=f"checking alone {inner:.2f} s: {gib / inner:.2f} GiB/s, "
                f"{cat_best / inner:.2f}x cat's speed",
            )
        )
    return rows


def table(rows: list[Row]) -> str:
    """Return the rows as a Markdown table."""
    lines = ["| case | best s | median s | ratio | note |", "|---|---:|---:|---|---|"]
    lines += [
        f"| {r.case} | {r.best_s:.2f} | {r.median_s:.2f} | {r.ratio} | {r.note} |" for r in rows
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
