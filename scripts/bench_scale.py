"""The scale axis of the benchmark: many small tensors resharded to many target ranks.

    python scripts/bench_scale.py [--tensors 2000] [--world-sizes 8,64,256,1024]
                                  [--nproc 1,2] [--layouts sharded,local] [--workdir .bench]
    python scripts/bench.py --scale ...   (the same)

The source (``bench_make_scale.py``, made once in WORKDIR) is a DCP checkpoint of about
TENSORS small tensors (a Linear stack and AdamW's state), so a run is bound by planning
and framing, not by I/O. For each layout (``--to sharded``: DCP; ``--to local``:
``fsdp2-ranks``, with ``--model bench_make_scale:model``), each target world size M and
each launch size N (N=1 standalone, N>1 under torchrun), one ``shardckpt convert --json``
is timed: its wall time as this script sees it, the phases and peak resident memory of
every rank from its own ``costs``. Then, in this process, framing alone: the output laid
out for every target rank (DCP's plan, each data file's layout; each rank file's
rendering) without a byte of tensor data, per (target rank x tensor). One markdown table
on stdout (or JSON with --json), progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
ROOT = SCRIPTS.parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
LAYOUTS = {"sharded": [], "local": ["--model", "bench_make_scale:model"]}


@dataclass
class Run:
    """One timed conversion, and what it reported it cost."""

    layout: str
    world_size: int
    nproc: int
    wall_s: float
    ok: bool
    phase_s: dict[str, float] = field(default_factory=dict)
    peak_rss_bytes: list[int] = field(default_factory=list)
    written_bytes: int = 0
    frame_us: float | None = None
    """Framing alone (in this process, N=1 only), per (target rank x tensor)."""
    error: str = ""


def log(message: str) -> None:
    """Print a progress line on stderr."""
    print(f"bench_scale: {message}", file=sys.stderr, flush=True)


def env() -> dict[str, str]:
    """Return the environment of a run: this checkout's shardckpt, the model factory importable."""
    path = os.pathsep.join([str(ROOT), str(SCRIPTS), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def ensure_source(workdir: Path, tensors: int) -> Path:
    """Return the source checkpoint of ``tensors`` tensors, made once under ``workdir``."""
    src = workdir / f"scale-{tensors}"
    if not (src / ".metadata").exists():
        log(f"writing the source ({tensors} tensors) to {src}")
        subprocess.run(
            [
                sys.executable,
                str(SCRIPTS / "bench_make_scale.py"),
                str(src),
                "--tensors",
                str(tensors),
            ],
            check=True,
            env=env(),
            stderr=subprocess.DEVNULL,
        )
    return src


def convert(src: Path, dst: Path, layout: str, world_size: int, nproc: int) -> Run:
    """Time one ``shardckpt convert --json``; return the run with the costs it reported."""
    args = ["convert", str(src), str(dst), "--to", layout, "--world-size", str(world_size)]
    args += [*LAYOUTS[layout], "--overwrite", "--json"]
    if nproc == 1:
        argv = [sys.executable, "-m", "shardckpt", *args]
    else:
        argv = [*TORCHRUN, f"--nproc-per-node={nproc}", "-m", "shardckpt", *args]
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env())
    wall = time.perf_counter() - start
    run = Run(layout, world_size, nproc, round(wall, 2), done.returncode == 0)
    if not run.ok:
        run.error = (done.stderr.strip().splitlines() or ["?"])[-1]
        return run
    costs = json.loads(done.stdout.strip().splitlines()[-1])["costs"]
    run.phase_s = costs["phase_seconds"]
    run.peak_rss_bytes = costs["peak_rss_bytes"]
    run.written_bytes = costs["written_bytes"]
    return run


FRAME_ONLY = """
import sys, tempfile, time
from pathlib import Path
from shardckpt import api
from shardckpt.api import conversion
from shardckpt.core.destination import Destination
from shardckpt.core.dist import Runtime
from shardckpt.formats import checkpoint_files

src, layout, world_size, model = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
runtime = Runtime()
with tempfile.TemporaryDirectory() as tmp:
    request = api.ConvertRequest(
        src=src, dst=Path(tmp) / "out", to=layout, world_size=world_size,
        model=model[0] if model else None,
    )
    form = conversion.output_format(request)
    valid = conversion.validate(request, form, runtime)
    destination = Destination(request.dst, overwrite=False, is_dir=True, srcs=(Path(src),),
                              checkpoint_files=checkpoint_files)
    prepared = conversion.prepare(request, valid, destination, runtime)
    writer = prepared.form.writer(Path(tmp) / "framed", prepared.plan)
    (Path(tmp) / "framed").mkdir()
    start = time.perf_counter()
    frame = writer.frame(runtime)
    for job in frame.files:
        segments, _ = job.layout()
        for _ in segments:
            pass
    took = time.perf_counter() - start
    print(took / (world_size * len(prepared.plan.tensors)) * 1e6)
"""


def frame_only(src: Path, layout: str, world_size: int) -> float | None:
    """Return framing's microseconds per (target rank x tensor), measured in a fresh process."""
    model = ["bench_make_scale:model"] if layout == "local" else []
    argv = [sys.executable, "-c", FRAME_ONLY, str(src), layout, str(world_size), *model]
    done = subprocess.run(argv, capture_output=True, text=True, env=env())
    if done.returncode != 0:
        log(f"framing alone failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
        return None
    return round(float(done.stdout.strip().splitlines()[-1]), 2)


def table(runs: list[Run], tensors: int) -> str:
    """Return the runs as one markdown table."""
    lines = [
        "| `--to` | M | N | wall s | plan | frame | write | flush | finish | framing µs/(rank×tensor) | peak RSS MiB (per rank) | written MB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        if not r.ok:
            lines.append(f"| {r.layout} | {r.world_size} | {r.nproc} | failed: {r.error} |")
            continue
        phases = " | ".join(
            f"{r.phase_s.get(p, 0.0):.1f}" for p in ("plan", "frame", "write", "flush", "finish")
        )
        rss = ", ".join(f"{b / 2**20:.0f}" for b in r.peak_rss_bytes)
        frame = "–" if r.frame_us is None else f"{r.frame_us:.1f}"
        lines.append(
            f"| {r.layout} | {r.world_size} | {r.nproc} | {r.wall_s:.1f} | {phases} | {frame} | "
            f"{rss} | {r.written_bytes / 1e6:.0f} |"
        )
    return f"{tensors} tensors\n\n" + "\n".join(lines)


def sizes(text: str) -> list[int]:
    """Return a comma-separated list of positive ints."""
    values = [int(v) for v in text.split(",") if v]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: want sizes >= 1, e.g. 8,64")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Return the command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=2000)
    parser.add_argument("--world-sizes", type=sizes, default=[8, 64, 256, 1024])
    parser.add_argument("--nproc", type=sizes, default=[1, 2])
    parser.add_argument("--layouts", default="sharded,local")
    parser.add_argument("--workdir", type=Path, default=ROOT / ".bench")
    parser.add_argument("--no-framing", action="store_true", help="skip framing-alone timing")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the scale cases; return 0 when every one succeeded."""
    args = parse_args(argv)
    workdir = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    src = ensure_source(workdir, args.tensors)
    runs = []
    for layout in args.layouts.split(","):
        for world_size in args.world_sizes:
            for nproc in args.nproc:
                with tempfile.TemporaryDirectory(dir=workdir) as tmp:
                    log(f"--to {layout} --world-size {world_size}, N={nproc}")
                    run = convert(src, Path(tmp) / "out", layout, world_size, nproc)
                if run.ok and nproc == 1 and not args.no_framing:
                    run.frame_us = frame_only(src, layout, world_size)
                log(json.dumps(asdict(run)))
                runs.append(run)
    if args.json:
        print(json.dumps({"tensors": args.tensors, "runs": [asdict(r) for r in runs]}, indent=2))
    else:
        print(table(runs, args.tensors))
    return 0 if all(r.ok for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
