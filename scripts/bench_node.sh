#!/usr/bin/env bash
# The one-node table of docs/benchmark.md: a full export and a verify on tmpfs, one process
# at --threads 1, 2, 4, 8 and 16, then N=2 and 8 processes under torchrun (each with its
# share of the cores, shardckpt's default), wall, CPU seconds per GB and peak RSS, on
# whatever machine runs it (written for a 16-core GPU node: under 8 minutes there with
# the default 4 GB, each case twice, taking turns, the median reported).
#
#   bash scripts/bench_node.sh [SIZE_GB] [OUT_DIR] [BASE]
#
# With BASE, a directory holding another version's `shardckpt` package (a checkout, or
# `git archive REV shardckpt | tar -x -C BASE`), the same cases run with that version
# first, on the same source, so the two tables compare on one machine at one moment.
#
# It needs a Python with torch, typer, safetensors, tqdm, numpy and isal (this checkout
# is put on PYTHONPATH; nothing is installed). Wheels in ./.whl are installed into
# /tmp/site first when isal is missing: a machine without a package index gets isal that way.
# WORKDIR is a tmpfs (/dev/shm), so the disk is out of the numbers and what is left is
# the CPU each byte costs. OUT_DIR (default .bench-node) receives the table, the JSON
# document and the log.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

size_gb="${1:-4}"
out="${2:-.bench-node}"
base="${3:-}"
mkdir -p "$out"
python="${PYTHON:-python3}"

if ! "$python" -c "import isal" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
site="${PYTHONPATH:-}"
export OMP_NUM_THREADS=1 TQDM_DISABLE=1 PYTHONUNBUFFERED=1

{
    echo "cores: $(nproc --all), this process may use $("$python" -c "import os; print(len(os.sched_getaffinity(0)))"); $(grep MemTotal /proc/meminfo)"
    df -h /dev/shm | tail -1
    TIMEFORMAT="python -c 'import torch, torch.distributed.checkpoint': %R s wall"
    for _ in 1 2; do time "$python" -c "import torch, torch.distributed.checkpoint"; done
} 2>&1 | tee "$out/machine.txt"

workdir=/dev/shm/shardckpt-bench-node
rc=0
# One bench run per version: (name, the directory its shardckpt package is in).
runs=()
[[ -n "$base" ]] && runs+=("base:$(cd "$base" && pwd)")
runs+=("this:$PWD")
for run in "${runs[@]}"; do
    name="${run%%:*}" tree="${run#*:}"
    export PYTHONPATH="$tree${site:+:$site}"
    echo "== $name: shardckpt from $tree" | tee -a "$out/bench.log"
    # The threads axis in one process, then the ranks axis (each rank's default threads:
    # the node's cores over LOCAL_WORLD_SIZE). A version without --threads runs the
    # first part at its own default only.
    threads=(--threads 1,2,4,8,16)
    "$python" -c "import shardckpt.engine.workers" 2>/dev/null || threads=()
    "$python" scripts/bench.py --size-gb "$size_gb" --nproc 1 "${threads[@]}" --rounds 2 \
        --layouts full-safetensors,verify --world-size 8 --workdir "$workdir" --keep \
        --json >"$out/bench-$name-threads.json" 2>>"$out/bench.log" || rc=$?
    "$python" scripts/bench.py --size-gb "$size_gb" --nproc 2,8 --rounds 2 \
        --layouts full-safetensors,verify --world-size 8 --workdir "$workdir" --keep \
        --json >"$out/bench-$name-ranks.json" 2>>"$out/bench.log" || rc=$?
    "$python" - "$out/bench-$name-threads.json" "$out/bench-$name-ranks.json" \
        >"$out/table-$name.md" <<'EOF'
import json, sys
sys.path.insert(0, "scripts")
import bench
fields = bench.Result.__dataclass_fields__
for i, path in enumerate(sys.argv[1:]):
    try:
        doc = json.load(open(path))
    except (OSError, ValueError):
        print(f"({path}: no results, see bench.log)\n")
        continue
    rows = [bench.Result(**{k: v for k, v in r.items() if k in fields}) for r in doc["results"]]
    if i:  # the references ran again: only the torchrun rows are new
        rows = rows[:1] + [r for r in rows if r.nproc > 1]
    else:
        print(bench.header(doc) + "\n")
    print(bench.table(rows) + "\n")
EOF
    cat "$out/table-$name.md"
done
tail -3 "$out/bench.log"
rm -rf "$workdir"
exit "$rc"
