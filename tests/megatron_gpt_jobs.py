"""A Llama-style megatron-core GPT (GQA, SwiGLU, RMSNorm, RoPE, local spec, CPU): saved with ``dist_checkpointing``, and its logits.

Run as a script, one process (``python megatron_gpt_jobs.py DIR [CKPT]``): it writes
``DIR/ckpt`` (``dist_checkpointing.save`` of the model's sharded state dict, torch_dist)
and ``DIR/logits.pt`` (the tokens and Megatron's forward on them); with CKPT, it loads
CKPT into the model instead (``DIR/loaded.pt``). ``MEGATRON_EXPERTS=E`` makes every
layer's MLP a mixture of E experts (SequentialMLP, top-2 router); ``MEGATRON_TIED=1``
shares the embedding with the output layer (which then stores no weight);
``MEGATRON_QKV_BIAS=1`` gives the QKV projection a bias (Qwen 2's layout). CPU shims as in
``megatron_jobs.py``, and one for the MoE router without Transformer Engine.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
import torch.distributed as dist

LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB, SEQ = 2, 64, 8, 2, 96, 128, 16
ROPE_BASE = 10000.0
EXPERTS = int(os.environ.get("MEGATRON_EXPERTS", "0"))
TIED = os.environ.get("MEGATRON_TIED") == "1"
QKV_BIAS = os.environ.get("MEGATRON_QKV_BIAS") == "1"
MOE = {"num_moe_experts": EXPERTS, "moe_router_topk": 2, "moe_ffn_hidden_size": 32}


def gpt():
    """Return the model: every weight drawn from a seeded generator."""
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        ffn_hidden_size=FFN,
        normalization="RMSNorm",
        layernorm_epsilon=1e-5,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=QKV_BIAS,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        **(MOE if EXPERTS else {}),
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(
            num_experts=EXPERTS or None, normalization="RMSNorm"
        ),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
        rotary_base=ROPE_BASE,
        share_embeddings_and_output_weights=TIED,
    )
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if "norm" in name else 0.0
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + base)
    return model.eval()


def training_args(older: bool = False) -> argparse.Namespace:
    """Return the ``args`` Megatron-LM's training loop saves with every checkpoint, for this model.

    Megatron-LM's ``save_checkpoint`` (``megatron/training/checkpointing.py``, its
    ``generate_state_dict``) puts its parsed command line, an ``argparse.Namespace``, in
    the state dict as ``args``, beside ``checkpoint_version`` 3.0 and ``iteration``.
    Megatron-LM is not on PyPI (megatron-core 0.16.1, installed, has no training loop),
    so the namespace is built here with the model fields of Megatron-LM's
    ``megatron/training/arguments.py`` at tag ``core_v0.16.1`` (checked against that
    source; its transformer options are ``TransformerConfig``'s fields there, so the
    norm's epsilon is ``layernorm_epsilon`` and ``--apply-layernorm-1p`` is
    ``layernorm_zero_centered_gamma``; ``older=True`` gives the names Megatron-LM used
    before, ``norm_epsilon`` and ``apply_layernorm_1p``), set as its parser and
    ``validate_args`` leave them for this model (``padded_vocab_size`` by ``_vocab_size_with_padding``: the
    vocabulary rounded up to 128 on one rank; 128 here).
    """
    return argparse.Namespace(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_attention_heads=HEADS,
        group_query_attention=True,
        num_query_groups=GROUPS,
        kv_channels=HIDDEN // HEADS,
        max_position_embeddings=SEQ,
        seq_length=SEQ,
        position_embedding_type="rope",
        rotary_base=int(ROPE_BASE),
        rotary_percent=1.0,
        rotary_interleaved=False,
        use_rope_scaling=False,
        rope_scaling_factor=8.0,
        normalization="RMSNorm",
        **(
            {"norm_epsilon": 1e-5, "apply_layernorm_1p": False}
            if older
            else {"layernorm_epsilon": 1e-5, "layernorm_zero_centered_gamma": False}
        ),
        swiglu=True,
        squared_relu=False,
        add_bias_linear=False,
        add_qkv_bias=QKV_BIAS,
        qk_layernorm=False,
        untie_embeddings_and_output_weights=not TIED,
        vocab_size=VOCAB,
        make_vocab_size_divisible_by=128,
        padded_vocab_size=VOCAB,
        num_experts=EXPERTS or None,
        moe_router_topk=2,
        moe_ffn_hidden_size=MOE["moe_ffn_hidden_size"] if EXPERTS else None,
        moe_shared_expert_intermediate_size=None,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=False,
        params_dtype=torch.float32,
        fp16=False,
        bf16=False,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
    )


def training_common_state() -> dict:
    """Return what Megatron-LM's ``save_checkpoint`` puts in the state dict beside the model (``common.pt``)."""
    return {"args": training_args(), "checkpoint_version": 3.0, "iteration": 10}


def load(ckpt: str, out: str) -> None:
    """Load ``ckpt`` into the model with ``dist_checkpointing.load``; ``torch.save`` its weights to ``out``.

    A Hugging Face model has no ``_extra_state`` (Transformer Engine's FP8 metadata,
    empty here): those entries are left out of what is loaded.
    """
    from megatron.core import dist_checkpointing

    model = gpt()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    wanted = {
        k: v
        for k, v in model.sharded_state_dict(prefix="").items()
        if not k.endswith("_extra_state")
    }
    loaded = dist_checkpointing.load({"model": wanted}, ckpt)
    result = model.load_state_dict(loaded["model"], strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    assert all(k.endswith("_extra_state") for k in result.missing_keys), result.missing_keys
    weights = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    torch.save(weights, out)


def main(out: str, load_into: str | None = None) -> None:
    """Save the model to ``out/ckpt`` and its logits to ``out/logits.pt``; or load ``load_into`` into it (``out/loaded.pt``)."""
    from megatron.core import dist_checkpointing

    torch.set_num_threads(1)
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"
    store = os.path.join(out, ".store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        if load_into is not None:
            load(load_into, os.path.join(out, "loaded.pt"))
            return
        model = gpt()
        # Attention dropout (0 here) runs under the CUDA RNG tracker's fork, which holds no
        # state on CPU: nothing is drawn, so a plain context stands in for it.
        from megatron.core.tensor_parallel import random as tp_random

        tp_random.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
        os.makedirs(os.path.join(out, "ckpt"))
        dist_checkpointing.save(
            {"model": model.sharded_state_dict(prefix=""), **training_common_state()},
            os.path.join(out, "ckpt"),
        )
        tokens = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(3))
        positions = torch.arange(SEQ).unsqueeze(0)
        mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
        if EXPERTS:
            # megatron-core 0.16.1's router tests ``te_general_gemm is not None``, a name
            # its module binds only when Transformer Engine imports: None is what it means.
            from megatron.core.transformer.moe import moe_utils

            moe_utils.te_general_gemm = None
        with torch.no_grad():
            logits = model(tokens, positions, mask)
        weights = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
        torch.save(
            {"tokens": tokens, "logits": logits, "weights": weights}, os.path.join(out, "logits.pt")
        )
        dist.barrier()
    finally:
        dist.destroy_process_group()
        if os.path.exists(store):
            os.remove(store)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
