#!/usr/bin/env bash
# Train a tiny FSDP2 model on 2 CPU ranks, then inspect, convert and diff its
# checkpoint with shardckpt. Everything is written under .demo/ (recreated each run).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

step="set up .venv"
trap 'rc=$?; [[ $rc -eq 0 ]] || printf "\ndemo: FAILED (exit %s) at: %s\n" "$rc" "$step" >&2' EXIT
heading() {
    step="$1"
    printf '\n==> %s\n' "$step"
}

bash scripts/setup.sh
export PATH="${SHARDCKPT_VENV:-$root/.venv}/bin:$PATH"
# torchrun would otherwise warn that it is setting this for every worker.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

torchrun=(python -m torch.distributed.run --standalone --nproc-per-node 2)
demo=.demo
rm -rf "$demo"
mkdir -p "$demo"

heading "1/6 train a small FSDP2 model on 2 CPU ranks and save a DCP checkpoint"
"${torchrun[@]}" examples/make_checkpoint.py "$demo/ckpt-dcp" --steps 3

heading "2/6 inspect the DCP checkpoint (metadata only)"
shardckpt inspect "$demo/ckpt-dcp"

heading "3/6 convert to one full torch.save file, in one process"
shardckpt convert "$demo/ckpt-dcp" "$demo/full.pt" --to full --overwrite

heading "4/6 convert to one full safetensors file, with 2 ranks under torchrun"
"${torchrun[@]}" -m shardckpt convert "$demo/ckpt-dcp" "$demo/full.safetensors" --to full --overwrite

heading "5/6 reshard the full file back into a DCP checkpoint for 4 ranks"
shardckpt convert "$demo/full.pt" "$demo/resharded" --to sharded --world-size 4 --overwrite

heading "6/6 diff the original and the round-tripped checkpoint (exit 0 = identical)"
shardckpt diff "$demo/ckpt-dcp" "$demo/resharded"

printf '\ndemo: all steps passed; outputs are in %s/\n' "$demo"
