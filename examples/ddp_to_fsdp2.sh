#!/usr/bin/env bash
# cpu-ok: runs on CPU (2 gloo ranks, ~20 s on 2 cores); no GPU needed.
# Train with plain DDP + torch.optim (a torch.save file: "module."-prefixed weights,
# optimizer state keyed by param IDs), convert it to an FSDP2 DCP checkpoint with
# shardckpt, resume with FSDP2 and check that the loss continues. Usage: [WORKDIR]
#
# Needs `shardckpt` on PATH (source .venv/bin/activate). N (DDP ranks) and M (FSDP2
# ranks) come from the environment (default 2 and 2); WORKDIR defaults to
# .examples/ddp_to_fsdp2 and is recreated. Exits non-zero when any step fails or the
# losses differ.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
work="${1:-.examples/ddp_to_fsdp2}"
N="${N:-2}"
M="${M:-2}"
# torchrun warns about OMP_NUM_THREADS for every launch unless it is set.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
command -v shardckpt >/dev/null || {
    echo "shardckpt is not on PATH: run 'source .venv/bin/activate' first" >&2
    exit 2
}
launch() { python -m torch.distributed.run --standalone --nproc-per-node "$@"; }

rm -rf "$work"
mkdir -p "$work"

echo "==> train 5 steps with DDP on $N ranks, torch.save-ing the state after step 3"
launch "$N" "$here/train.py" --parallel ddp --steps 5 \
    --save-at 3 --save "$work/ddp-step-3.pt" --losses "$work/losses-ddp.json"

echo "==> convert to DCP for FSDP2 on $M ranks, param IDs -> FQNs"
# Param IDs are positions in the optimizer's param groups: --model names the factory
# that builds the model and its groups as training did (examples/make_checkpoint.py),
# so shardckpt can tell which FQN each ID stands for. It builds it on the meta device.
PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" shardckpt convert \
    "$work/ddp-step-3.pt" "$work/fsdp2-step-3" --to sharded --world-size "$M" \
    --optim-keys fqn --model make_checkpoint:model_and_param_groups

echo "==> resume with FSDP2 on $M ranks (dcp.load + set_state_dict), steps 4 and 5"
launch "$M" "$here/train.py" --parallel fsdp2 --resume "$work/fsdp2-step-3" --steps 2 \
    --losses "$work/losses-fsdp2.json"

echo "==> compare the losses of steps 4 and 5"
python "$here/check_losses.py" "$work/losses-ddp.json" "$work/losses-fsdp2.json"
