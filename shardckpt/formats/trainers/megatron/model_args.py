"""Megatron-LM's ``args`` in ``common.pt`` as a Hugging Face ``config.json``.

Megatron-LM's training loop saves its parsed command line (an ``argparse.Namespace``,
read here as the attribute bag the weights-only loader admits, never run) with every
checkpoint. Its model fields (``megatron/training/arguments.py``) say what a
``config.json`` needs for the Llama-style GPT the ``megatron_gpt`` mapping covers, its
Qwen 2 form with a QKV bias (``megatron_qwen2``), or its mixture-of-experts form
(``megatron_moe``, as Mixtral): sizes, grouped-query
attention, the SwiGLU width, RoPE's base and scaling, the norm's epsilon, the padded
vocabulary, whether the output layer is the embedding. A field missing, or a value
that no such model computes (LayerNorm, biases, a GELU MLP, shared experts), is
refused naming it: the user's own ``config.json`` (``--hf-config``) then says.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from shardckpt.core.errors import BadInputError
from shardckpt.core.lazy_torch import torch

_NEEDED = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "padded_vocab_size",
    "max_position_embeddings",
    "normalization",
    "layernorm_epsilon",
    "position_embedding_type",
    "swiglu",
    "add_bias_linear",
    "untie_embeddings_and_output_weights",
)
"""Fields every export needs, whatever their value."""

# Fields a Megatron-LM older than the field saved without it, with the value its code
# then fixed; and fields that only ever add to the model, off when absent.
_DEFAULTS = {
    "group_query_attention": False,
    "kv_channels": None,
    "rotary_base": 10000,
    "rotary_percent": 1.0,
    "rotary_interleaved": False,
    "use_rope_scaling": False,
    "rope_scaling_factor": 8.0,
    "add_qkv_bias": False,
    "qk_layernorm": False,
    "layernorm_zero_centered_gamma": False,
    "num_experts": None,
    "moe_ffn_hidden_size": None,
    "moe_shared_expert_intermediate_size": None,
    "moe_router_pre_softmax": False,
    "moe_router_score_function": "softmax",
}

# Values no Llama-style or Mixtral model computes: (field, the value it must have, what it means).
_MUST = (
    ("normalization", "RMSNorm", "the norms are RMSNorm"),
    ("position_embedding_type", "rope", "positions are rotary"),
    ("swiglu", True, "the MLP is SwiGLU"),
    ("add_bias_linear", False, "the linear layers have no bias"),
    ("qk_layernorm", False, "queries and keys are not normalised"),
    ("layernorm_zero_centered_gamma", False, "norm weights are not stored minus one"),
    ("rotary_percent", 1.0, "every channel of a head rotates"),
    ("rotary_interleaved", False, "RoPE rotates halves"),
    ("moe_shared_expert_intermediate_size", None, "no shared experts"),
    ("moe_router_pre_softmax", False, "the router softmaxes its top k"),
    ("moe_router_score_function", "softmax", "the router softmaxes its top k"),
)

# Fields Megatron-LM saves under another name since its transformer options became
# ``TransformerConfig``'s (core_v0.16: ``--norm-epsilon`` is kept as
# ``layernorm_epsilon``, ``--apply-layernorm-1p`` as ``layernorm_zero_centered_gamma``):
# the newer name, then the older one, read where the newer is absent.
_RENAMED = (
    ("layernorm_epsilon", "norm_epsilon"),
    ("layernorm_zero_centered_gamma", "apply_layernorm_1p"),
)

_HINT = (
    "pass --hf-config DIR, the directory of the model's config.json, or --format "
    "safetensors to keep Megatron's names"
)


EMBEDDING = "embedding.word_embeddings.weight"
"""megatron-core's GPT input embedding: (padded vocabulary, hidden size)."""


def hf_config(args: object, path: Path, embedding: tuple[int, ...] | None = None) -> dict:
    """Return the ``config.json`` of the model Megatron's ``args`` (from ``path``) describe, or refuse naming what it lacks.

    ``embedding`` is the shape of SRC's ``EMBEDDING``: args that say another vocabulary or
    width belong to another model (a ``common.pt`` copied beside the wrong weights).
    """
    given: Mapping = vars(args) if hasattr(args, "__dict__") else args  # type: ignore[assignment]
    if not isinstance(given, Mapping):
        raise BadInputError(
            f"its 'args' is a {type(args).__name__}, not Megatron-LM's argument namespace",
            path=path,
            hint=_HINT,
        )
    given = {**given}
    for newer, older in _RENAMED:
        if given.get(newer) is None and given.get(older) is not None:
            given[newer] = given[older]
    missing = [f for f in _NEEDED if given.get(f) is None]
    if given.get("group_query_attention") and given.get("num_query_groups") is None:
        missing.append("num_query_groups")
    if missing:
        raise BadInputError(
            f"its args lack {', '.join(repr(f) for f in missing)}, which the model's "
            "config.json needs",
            path=path,
            hint=_HINT,
        )
    a = {**_DEFAULTS, **given}
    for field, value, meaning in _MUST:
        if a[field] != value:
            raise BadInputError(
                f"its args say {field}={a[field]!r}, and the Llama, Qwen 2 and Mixtral models "
                f"the Megatron mappings write need {field}={value!r} ({meaning})",
                path=path,
                hint=_HINT,
            )
    said = (a["padded_vocab_size"], a["hidden_size"])
    if embedding is not None and tuple(embedding) != said:
        raise BadInputError(
            f"its args say padded_vocab_size={said[0]}, hidden_size={said[1]}, and SRC's "
            f"'{EMBEDDING}' is {'x'.join(map(str, embedding))}: they describe another model",
            path=path,
            hint=_HINT,
        )
    heads = a["num_attention_heads"]
    experts = a["num_experts"]
    if experts and a["add_qkv_bias"]:
        raise BadInputError(
            "its args say add_qkv_bias=True with num_experts: no shipped mapping writes a "
            "mixture of experts with a QKV bias",
            path=path,
            hint=_HINT,
        )
    arch, model_type = (
        ("MixtralForCausalLM", "mixtral")
        if experts
        else ("Qwen2ForCausalLM", "qwen2")
        if a["add_qkv_bias"]
        else ("LlamaForCausalLM", "llama")
    )
    config = {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": a["padded_vocab_size"],
        "hidden_size": a["hidden_size"],
        "intermediate_size": (a["moe_ffn_hidden_size"] or a["ffn_hidden_size"])
        if experts
        else a["ffn_hidden_size"],
        "num_hidden_layers": a["num_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": a["num_query_groups"] if a["group_query_attention"] else heads,
        "head_dim": a["kv_channels"] or a["hidden_size"] // heads,
        "hidden_act": "silu",
        "rms_norm_eps": a["layernorm_epsilon"],
        "rope_theta": float(a["rotary_base"]),
        "max_position_embeddings": a["max_position_embeddings"],
        "tie_word_embeddings": not a["untie_embeddings_and_output_weights"],
        "torch_dtype": _dtype(a),
    }
    if a["use_rope_scaling"]:
        # megatron-core's RotaryEmbedding._apply_scaling: Llama 3.1's, these fixed.
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": float(a["rope_scaling_factor"]),
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    if experts:
        config["num_local_experts"] = experts
        config["num_experts_per_tok"] = a.get("moe_router_topk", 2)
    elif not a["add_qkv_bias"]:
        config["attention_bias"] = config["mlp_bias"] = False
    return config


def _dtype(args: Mapping) -> str:
    """Return the dtype name the model was trained in: ``params_dtype``, else the bf16/fp16 flags."""
    dtype = args.get("params_dtype")
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    return "bfloat16" if args.get("bf16") else "float16" if args.get("fp16") else "float32"
