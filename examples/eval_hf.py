"""Load a Hugging Face safetensors export into the model and run an eval forward.

helper: run by export_hf_eval.sh (not an example on its own); one process, CPU.

    python examples/eval_hf.py HF_DIR [--reference DCP_DIR] [--rtol 0.02]

HF_DIR is what ``shardckpt convert CKPT HF_DIR --to full --format hf --only model``
writes: ``*.safetensors`` shards and ``model.safetensors.index.json``, whose
``weight_map`` names the shard of every tensor. Each shard is read with
``safetensors.torch.load_file`` and the weights are loaded with
``model.load_state_dict`` (strict: every key of the model, no other), in the dtype the
export has (bf16 here). With ``--reference`` the same eval runs on the fp32 training
checkpoint, read with ``dcp.load`` in this one process; the two eval losses must agree
within ``--rtol`` (bf16 keeps ~3 significant digits), or the exit code is 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from make_checkpoint import SEQ_LEN, VOCAB, build_model
from safetensors.torch import load_file


def load_hf(hf_dir: str) -> dict[str, torch.Tensor]:
    """Return every tensor of the hf export, read shard by shard."""
    with open(os.path.join(hf_dir, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        state.update(load_file(os.path.join(hf_dir, shard)))
    return state


def load_dcp_model(ckpt_dir: str) -> dict[str, torch.Tensor]:
    """Return the model state of a DCP checkpoint, as full tensors, read in one process."""
    state = {"model": build_model().state_dict()}
    with warnings.catch_warnings():
        # DCP warns that it runs without a process group: here that is the point.
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(state, checkpoint_id=ckpt_dir)
    return state["model"]


@torch.no_grad()
def eval_loss(state: dict[str, torch.Tensor]) -> float:
    """Return the mean next-token loss of the model holding ``state`` on a fixed batch."""
    dtype = state["embed.weight"].dtype
    model = build_model().to(dtype).eval()
    model.load_state_dict(state)  # strict: a missing or extra key is an error
    gen = torch.Generator().manual_seed(12345)
    tokens = torch.randint(VOCAB, (16, SEQ_LEN + 1), generator=gen)
    logits = model(tokens[:, :-1]).float()
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).item()


def main() -> int:
    """Evaluate the export (and the reference); return the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("hf_dir", help="directory written by --to full --format hf")
    parser.add_argument("--reference", help="the DCP checkpoint the export was made from")
    parser.add_argument("--rtol", type=float, default=0.02, help="relative tolerance")
    args = parser.parse_args()
    torch.set_num_threads(1)

    state = load_hf(args.hf_dir)
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in state.values()})
    loss = eval_loss(state)
    print(f"eval loss of {args.hf_dir} ({len(state)} tensors, {', '.join(dtypes)}): {loss:.4f}")
    if args.reference is None:
        return 0
    ref = eval_loss(load_dcp_model(args.reference))
    ok = abs(loss - ref) <= args.rtol * abs(ref)
    print(
        f"eval loss of {args.reference} (float32): {ref:.4f}; relative difference "
        f"{abs(loss - ref) / abs(ref):.1e} {'ok' if ok else 'DIFFERS'} (rtol {args.rtol:g})"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
