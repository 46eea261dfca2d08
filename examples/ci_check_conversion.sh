#!/usr/bin/env bash
# cpu-ok: runs on CPU (2 gloo ranks make the checkpoint; ~18 s on 2 cores).
# A CI pipeline step: convert a checkpoint to one full torch.save file, read it back
# (--verify), diff it against a reference, and fail the pipeline on any difference,
# reading shardckpt's --json output with jq, or with Python where jq is missing.
#
#   examples/ci_check_conversion.sh [SRC REFERENCE [WORKDIR]]
#
# SRC is the training checkpoint (any format shardckpt reads), REFERENCE what its
# conversion must equal (e.g. the full state the training job gathered itself).
# Without them, the script first makes both with examples/make_checkpoint.py on 2
# ranks. WORKDIR defaults to .examples/ci_check_conversion and is recreated. Exit 0
# when the conversion equals SRC and REFERENCE, non-zero otherwise. In a GitHub
# Actions job: `- run: examples/ci_check_conversion.sh ckpt/step-1000 ref/step-1000.pt`.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
work="${3:-.examples/ci_check_conversion}"
# torchrun warns about OMP_NUM_THREADS for every launch unless it is set.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
command -v shardckpt >/dev/null || {
    echo "shardckpt is not on PATH: run 'source .venv/bin/activate' first" >&2
    exit 2
}

# json_get FILE EXPR: print EXPR (jq syntax, .key or .key[]) of the JSON in FILE,
# one line per value. Uses $JQ (default jq) when found; JQ= forces the Python path.
jq="${JQ-jq}"
json_get() {
    if [[ -n "$jq" ]] && command -v "$jq" >/dev/null; then
        "$jq" -c -r "$2" "$1"
    else
        python - "$1" "$2" <<'PY'
import json, sys
value = json.load(open(sys.argv[1]))
expr = sys.argv[2]
for key in expr.strip(".").removesuffix("[]").split("."):
    value = value[key] if key else value
for item in value if expr.endswith("[]") else [value]:
    print(json.dumps(item, separators=(",", ":")) if isinstance(item, (dict, list)) else item)
PY
    fi
}

rm -rf "$work"
mkdir -p "$work"

if [[ $# -ge 2 ]]; then
    src="$1"
    ref="$2"
else
    echo "==> no SRC given: train a small FSDP2 model on 2 ranks for a checkpoint and its reference"
    src="$work/step-3"
    ref="$work/step-3-reference.pt"
    python -m torch.distributed.run --standalone --nproc-per-node 2 \
        "$here/make_checkpoint.py" "$src" --steps 3 --full-ref "$ref"
fi

echo "==> convert $src to one torch.save file, reading it back (--verify)"
# set -e fails the step on any conversion error: exit 3 bad input, 4 I/O, 5 DST exists.
shardckpt convert "$src" "$work/full.pt" --to full --verify --json >"$work/convert.json"
tensors="$(json_get "$work/convert.json" .tensors)"
if [[ "$tensors" -eq 0 ]]; then
    echo "FAIL: the conversion wrote no tensors (check --only/--filter)" >&2
    exit 1
fi
echo "converted $tensors tensors, $(json_get "$work/convert.json" .nbytes) bytes," \
    "in $(json_get "$work/convert.json" .seconds) s"

echo "==> diff the conversion against $ref"
rc=0
shardckpt diff "$work/full.pt" "$ref" --json >"$work/diff.json" || rc=$?
case "$rc" in
0)
    echo "equal: $(json_get "$work/diff.json" .compared) leaves compared"
    ;;
1)
    echo "FAIL: the conversion differs from $ref at:" >&2
    json_get "$work/diff.json" '.differences[]' | head -n 20 >&2
    exit 1
    ;;
*)
    echo "FAIL: shardckpt diff could not compare (exit $rc)" >&2
    exit "$rc"
    ;;
esac
