"""The I/O axis of the benchmark: a full export, --verify and diff against cp and cmp.

    python scripts/bench_io.py [--size-gb 1.0] [--pairs 3] [--workdir .bench] [--keep]
                               [--diff-only] [--against CHECKOUT]

On the FSDP2 DCP source of ``bench.py`` (built once in WORKDIR, about SIZE_GB, model +
AdamW), each round runs, one after the other so that each pair sees the same machine:
``cp -r SRC COPY && sync``; ``shardckpt convert SRC out.safetensors --to full`` (and
``sync``); the same to a full ``torch.save`` file (``out.pt``); the safetensors export
with ``--verify``; ``cmp`` of every file of SRC with COPY's; ``shardckpt diff SRC COPY``;
and the import of torch and DCP that every conversion starts with (and ``diff`` where two
tensors' bytes differ; a ``diff`` of equal checkpoints of these formats imports no torch). The table gives each command's median wall time and CPU time
(user + system, the command's processes) over the rounds, and the ratios the issue's
targets are stated in: the exports against ``cp -r && sync``, ``--verify`` against the
export without it, ``diff`` (and the import) against ``cmp``. The source is in the page cache (it was just read), as
in ``bench.py``. ``--diff-only`` times only ``cmp``, ``diff`` and the import (COPY made
once, untimed); ``--against CHECKOUT`` adds that checkout's ``diff`` to each round
(before and after a change, on the same machine at the same moment).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import bench

IMPORTS = "import torch.distributed.checkpoint"
"""What every conversion of a DCP source imports before its first read (``diff`` did too)."""


def timed(argv: list[str], shell: bool = False, root: Path = bench.ROOT) -> tuple[float, float]:
    """Return the wall and CPU seconds (user + system) ``argv`` took, run with the shardckpt
    of checkout ``root``; raise if it failed."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    env = bench_env(root)
    done = subprocess.run(argv, shell=shell, capture_output=True, text=True, env=env, cwd=root)
    took = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"{argv}: exit {done.returncode}: {done.stderr.strip()[-500:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return took, cpu


def synced(argv: list[str]) -> tuple[float, float]:
    """Return ``timed`` of ``argv`` followed by ``sync``, both counted."""
    wall, cpu = timed(argv)
    sync_wall, sync_cpu = timed(["sync"])
    return wall + sync_wall, cpu + sync_cpu


def bench_env(root: Path = bench.ROOT) -> dict[str, str]:
    """Return the environment the commands run in: checkout ``root``'s shardckpt, one thread."""
    path = os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def cmp_all(a: Path, b: Path) -> list[str]:
    """Return the shell command comparing every file of ``a`` with the one of that name in ``b``."""
    names = sorted(p.name for p in a.iterdir())
    return [" && ".join(f"cmp '{a / n}' '{b / n}'" for n in names)]


def one_round(
    src: Path, workdir: Path, diff_only: bool = False, against: Path | None = None
) -> dict[str, tuple[float, float]]:
    """Return each command's wall and CPU seconds in one round."""
    copy, out = workdir / "io-copy", workdir / "io-out.safetensors"
    out_pt = workdir / "io-out.pt"
    shardckpt = [sys.executable, "-m", "shardckpt"]
    export = [*shardckpt, "convert", str(src), str(out), "--to", "full", "--format"]
    export += ["safetensors", "--overwrite", "--quiet"]
    export_pt = [*shardckpt, "convert", str(src), str(out_pt), "--to", "full", "--format"]
    export_pt += ["torch", "--overwrite", "--quiet"]
    times = {}
    if diff_only:
        if not copy.exists():
            shutil.copytree(src, copy)
    else:
        shutil.rmtree(copy, ignore_errors=True)
        times["cp -r && sync"] = timed([f"cp -r '{src}' '{copy}' && sync"], shell=True)
        times["export"] = synced(export)
        out.unlink(missing_ok=True)
        times["export .pt"] = synced(export_pt)
        out_pt.unlink(missing_ok=True)
        times["export --verify"] = synced([*export, "--verify"])
    diff = [*shardckpt, "diff", str(src), str(copy), "--quiet"]
    times["cmp"] = timed(cmp_all(src, copy), shell=True)
    times["diff"] = timed(diff)
    if against is not None:
        times[f"diff at {against}"] = timed(diff, root=against)
    times["import torch + dcp"] = timed([sys.executable, "-c", IMPORTS])
    if not diff_only:
        shutil.rmtree(copy, ignore_errors=True)
        out.unlink(missing_ok=True)
    return times


def table(medians: dict[str, tuple[float, float]], src_bytes: int, rounds: int) -> str:
    """Return the medians and the target ratios as markdown."""
    lines = [
        f"source {src_bytes / 1e9:.2f} GB, median of {rounds} rounds",
        "",
        "| command | wall s | CPU s | ratio | target |",
        "|---|---:|---:|---:|---|",
    ]
    ratios = {
        "export": ("cp -r && sync", "≤ 1.5× cp -r && sync"),
        "export .pt": ("cp -r && sync", ""),
        "export --verify": ("export", "≤ 2× export"),
        "diff": ("cmp", "≤ 2× cmp"),
        "import torch + dcp": ("cmp", "convert's floor"),
    }
    for name, (wall, cpu) in medians.items():
        base, target = ratios.get(name, ("cmp" if name.startswith("diff") else None, ""))
        ratio = f"{wall / medians[base][0]:.2f}× {base}" if base else ""
        lines.append(f"| {name} | {wall:.2f} | {cpu:.2f} | {ratio} | {target} |")
    return "\n".join(lines)


def main() -> int:
    """Run the rounds; print the table (or JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--pairs", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--workdir", type=Path, default=bench.ROOT / ".bench")
    parser.add_argument("--keep", action="store_true", help="keep the source for the next run")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--diff-only", action="store_true", help="time cmp, diff and the import")
    parser.add_argument("--against", type=Path, help="another checkout whose diff to time too")
    args = parser.parse_args()
    workdir = args.workdir.resolve()
    src = bench.ensure_source(workdir, args.size_gb)
    src_bytes = bench.tree_bytes(src)
    rounds = []
    try:
        for i in range(args.pairs):
            rounds.append(one_round(src, workdir, args.diff_only, args.against))
            shown = {k: [round(v, 2) for v in t] for k, t in rounds[-1].items()}
            bench.log(f"round {i + 1} (wall, CPU s): {json.dumps(shown)}")
    finally:
        shutil.rmtree(workdir / "io-copy", ignore_errors=True)
        if not args.keep:
            shutil.rmtree(src, ignore_errors=True)
    medians = {
        name: (
            statistics.median(r[name][0] for r in rounds),
            statistics.median(r[name][1] for r in rounds),
        )
        for name in rounds[0]
    }
    if args.json:
        print(json.dumps({"rounds": rounds, "median": medians}, indent=2))
    else:
        print(table(medians, src_bytes, len(rounds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
