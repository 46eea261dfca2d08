#!/usr/bin/env bash
# cpu-ok: runs on CPU (2 then 3 gloo ranks, ~25 s on 2 cores); no GPU needed.
# Train with FSDP2 on N ranks, convert the DCP checkpoint to M ranks with shardckpt,
# resume training on M ranks, and check that the loss continues exactly where the
# uninterrupted N-rank run went. Usage: examples/reshard_and_resume.sh [WORKDIR]
#
# Needs `shardckpt` on PATH (source .venv/bin/activate). N and M come from the
# environment (default N=2, M=3); WORKDIR defaults to .examples/reshard_and_resume
# and is recreated. Exits non-zero when any step fails or the losses differ.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
work="${1:-.examples/reshard_and_resume}"
N="${N:-2}"
M="${M:-3}"
# torchrun warns about OMP_NUM_THREADS for every launch unless it is set.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
command -v shardckpt >/dev/null || {
    echo "shardckpt is not on PATH: run 'source .venv/bin/activate' first" >&2
    exit 2
}
launch() { python -m torch.distributed.run --standalone --nproc-per-node "$@"; }

rm -rf "$work"
mkdir -p "$work"

echo "==> train 5 steps on $N ranks, saving a DCP checkpoint after step 3"
# Steps 4 and 5 are the uninterrupted run the resumed one must reproduce.
launch "$N" "$here/train.py" --parallel fsdp2 --steps 5 \
    --save-at 3 --save "$work/step-3" --losses "$work/losses-uninterrupted.json"

echo "==> convert the checkpoint for $M ranks"
shardckpt convert "$work/step-3" "$work/step-3-at-$M" --to sharded --world-size "$M"

echo "==> resume on $M ranks (dcp.load + set_state_dict) and run steps 4 and 5"
launch "$M" "$here/train.py" --parallel fsdp2 --resume "$work/step-3-at-$M" --steps 2 \
    --losses "$work/losses-resumed.json"

echo "==> compare the losses of steps 4 and 5"
python "$here/check_losses.py" "$work/losses-uninterrupted.json" "$work/losses-resumed.json"
