#!/usr/bin/env bash
# cpu-ok: runs on CPU (2 gloo ranks make the checkpoint; ~18 s on 2 cores).
# Export a training checkpoint's model weights to Hugging Face sharded safetensors in
# bf16 for evaluation, load them with safetensors.torch.load_file into the model and
# run an eval forward, checking the loss against the fp32 checkpoint's.
#
#   examples/export_hf_eval.sh [CKPT [WORKDIR]]
#
# CKPT is a DCP checkpoint of examples/make_checkpoint.py's model (without it, the
# script makes one on 2 ranks). WORKDIR defaults to .examples/export_hf_eval and is
# recreated. Needs `shardckpt` on PATH (source .venv/bin/activate).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
work="${2:-.examples/export_hf_eval}"
# torchrun warns about OMP_NUM_THREADS for every launch unless it is set.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
command -v shardckpt >/dev/null || {
    echo "shardckpt is not on PATH: run 'source .venv/bin/activate' first" >&2
    exit 2
}

rm -rf "$work"
mkdir -p "$work"

if [[ $# -ge 1 ]]; then
    ckpt="$1"
else
    echo "==> no CKPT given: train a small FSDP2 model on 2 ranks for a checkpoint"
    ckpt="$work/step-3"
    python -m torch.distributed.run --standalone --nproc-per-node 2 \
        "$here/make_checkpoint.py" "$ckpt" --steps 3
fi

echo "==> export the model weights (no optimizer state) to hf safetensors in bf16"
# --max-shard-size splits the export into several files, as a large model's would be.
shardckpt convert "$ckpt" "$work/hf-model" --to full --format hf --only model --dtype bf16 \
    --max-shard-size 20KB
ls "$work/hf-model"

echo "==> load the export with safetensors.torch.load_file and evaluate it"
python "$here/eval_hf.py" "$work/hf-model" --reference "$ckpt"
