"""Benchmark: a torchtitan Llama 3 checkpoint of about 1 GB to a Hugging Face model, shardckpt against torchtitan's own way.

    python scripts/bench_mapping.py [--workdir .bench-map] [--layers 3]

torchtitan's way is what its ``scripts/checkpoint_conversion/convert_to_hf.py`` does
(torchtitan 0.3; the script is not in the wheel): the model built on the meta device,
its state dict given memory and filled by ``dcp.load``, ``Llama3StateDictAdapter.to_hf``,
then ``dcp.save`` with torch's ``HuggingFaceStorageWriter`` (consolidated into
``model-*.safetensors``). shardckpt's is ``convert --format hf --map llama3``. Each runs
in a process of its own; wall seconds and the process's peak RSS are reported, and the
two outputs are compared tensor by tensor, bit for bit.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def _model(layers: int):
    """Return torchtitan's Llama 3 config: dim 2048, 32 heads over 8, FFN 8192, vocab 32000."""
    from torchtitan.models import llama3 as family
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

    dim, vocab = 2048, 32000
    return Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab, embedding_dim=dim, param_init=family._EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=family._NORM_INIT),
        lm_head=Linear.Config(
            in_features=dim, out_features=vocab, param_init=family._output_linear_init(dim)
        ),
        layers=_build_llama3_layers(
            fuse_qkv=True,
            n_layers=layers,
            dim=dim,
            n_heads=32,
            n_kv_heads=8,
            hidden_dim=8192,
            rope=ComplexRoPE.Config(dim=64, max_seq_len=8192, theta=500000, scaling="llama"),
            attn_backend="flex",
        ),
    )


def make(workdir: Path, layers: int) -> None:
    """Write ``workdir/step-0`` (torchtitan's model-only DCP) and ``workdir/config/config.json``."""
    import torch.distributed.checkpoint as dcp

    config = _model(layers)
    with torch.device("meta"):
        model = config.build()
    gen = torch.Generator().manual_seed(0)
    state = {k: torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}
    dcp.save(state, checkpoint_id=workdir / "step-0", no_dist=True)
    (workdir / "config").mkdir(exist_ok=True)
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": layers,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    (workdir / "config" / "config.json").write_text(json.dumps(hf))


def titan(workdir: Path, layers: int) -> None:
    """Convert as torchtitan's convert_to_hf.py does, into ``workdir/titan-hf``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torchtitan.models.llama3 import Llama3StateDictAdapter

    config = _model(layers)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    state = model.state_dict()
    dcp.load(state, checkpoint_id=workdir / "step-0", no_dist=True)
    hf = Llama3StateDictAdapter(config, None).to_hf(state)
    writer = HuggingFaceStorageWriter(
        path=str(workdir / "titan-hf"), save_distributed=True, enable_consolidation=True
    )
    dcp.save(hf, storage_writer=writer, no_dist=True)


# Run as the parent of one command: its RUSAGE_CHILDREN peak is that command's alone.
_WRAP = (
    "import resource, subprocess, sys; "
    "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)"
)


def timed(argv: list[str]) -> tuple[float, int]:
    """Return the wall seconds and peak RSS (bytes) of ``argv`` run to completion."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", _WRAP, *argv], check=True, capture_output=True, text=True
    )
    return time.perf_counter() - start, int(done.stdout.split()[-1])


def same(a: Path, b: Path) -> bool:
    """Return whether the safetensors files of directories ``a`` and ``b`` hold the same tensors, bit for bit."""
    from safetensors.torch import load_file

    def weights(root: Path) -> dict:
        out = {}
        for f in sorted(root.glob("*.safetensors")):
            out.update(load_file(f))
        return out

    x, y = weights(a), weights(b)
    return sorted(x) == sorted(y) and all(
        x[k].dtype == y[k].dtype and torch.equal(x[k].view(torch.uint8), y[k].view(torch.uint8))
        for k in x
    )


def main() -> None:
    """Make the source, run both conversions (each in a process of its own) and print a table."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", type=Path, default=Path(".bench-map"))
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--step", choices=("make", "titan"))
    args = parser.parse_args()
    if args.step == "make":
        return make(args.workdir, args.layers)
    if args.step == "titan":
        return titan(args.workdir, args.layers)
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    me = [sys.executable, __file__, "--workdir", str(args.workdir), "--layers", str(args.layers)]
    subprocess.run([*me, "--step", "make"], check=True)
    size = sum(p.stat().st_size for p in (args.workdir / "step-0").iterdir())
    ours = timed(
        [sys.executable, "-m", "shardckpt", "convert", str(args.workdir / "step-0"),
         str(args.workdir / "ours-hf"), "--to", "full", "--format", "hf", "--hf-config",
         str(args.workdir / "config"), "--map", "llama3", "-q"]
    )  # fmt: skip
    theirs = timed([*me, "--step", "titan"])
    exact = same(args.workdir / "ours-hf", args.workdir / "titan-hf")
    print(f"source: torchtitan llama3 DCP, {size / 1e9:.2f} GB, {args.layers} layers")
    print("| conversion | wall s | peak RSS GiB | exact |")
    print("|---|---|---|---|")
    for name, (wall, rss) in (("shardckpt --map llama3", ours), ("torchtitan to_hf", theirs)):
        print(f"| {name} | {wall:.1f} | {rss / 2**30:.2f} | {'yes' if exact else 'no'} |")
    shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
