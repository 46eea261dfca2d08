"""Tiny torchtitan 0.3 models (Llama 3 with grouped-query attention, DeepSeek-V3 with MoE), their DCP and config.json.

Built with torchtitan's own model code and configs, weights drawn from a seeded
generator, saved with ``dcp.save`` as torchtitan saves a model-only step: the FQNs at
the top level. The ``config.json`` describes the same model to transformers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp


@dataclass
class TitanModel:
    """A built torchtitan model, its config, its state dict, and the adapter torchtitan converts it with."""

    model: torch.nn.Module
    config: object
    state: dict[str, torch.Tensor]
    adapter: object
    hf_config: dict


def _seeded(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _built(config) -> torch.nn.Module:
    """Return the model of ``config`` built on the meta device, then given CPU memory and its buffers."""
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    model.init_states(buffer_device=torch.device("cpu"))
    return model


def _dense(vocab: int, dim: int, hidden: int, layers: int, heads: int, kv_heads: int) -> dict:
    """Return the ``config.json`` sizes of a dense decoder."""
    return {
        "vocab_size": vocab,
        "hidden_size": dim,
        "intermediate_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
    }


def _hf_config(arch: str, model_type: str, **sizes) -> dict:
    """Return a ``config.json`` of ``arch``: ``sizes``, fp32, untied, SiLU."""
    return {
        "architectures": [arch],
        "model_type": model_type,
        **sizes,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }


def _ends(family, dim: int, vocab: int) -> dict:
    """Return the embedding, final norm and output head configs of a torchtitan ``family`` module."""
    from torchtitan.models.common import Embedding, Linear, RMSNorm

    return {
        "dim": dim,
        "vocab_size": vocab,
        "tok_embeddings": Embedding.Config(
            num_embeddings=vocab, embedding_dim=dim, param_init=family._EMBEDDING_INIT
        ),
        "norm": RMSNorm.Config(normalized_shape=dim, param_init=family._NORM_INIT),
        "lm_head": Linear.Config(
            in_features=dim, out_features=vocab, param_init=family._output_linear_init(dim)
        ),
    }


def llama3(layers: int = 2) -> TitanModel:
    """Return a Llama 3 of ``layers`` layers: dim 64, 8 query heads over 2 key/value heads (GQA)."""
    from torchtitan.models import llama3 as family
    from torchtitan.models.common import ComplexRoPE
    from torchtitan.models.llama3 import Llama3Model, Llama3StateDictAdapter, _build_llama3_layers

    dim, heads, kv_heads, vocab, hidden = 64, 8, 2, 128, 96
    rope = ComplexRoPE.Config(dim=dim // heads, max_seq_len=256, theta=500000, scaling="llama")
    config = Llama3Model.Config(
        **_ends(family, dim, vocab),
        layers=_build_llama3_layers(
            fuse_qkv=True,
            n_layers=layers,
            dim=dim,
            n_heads=heads,
            n_kv_heads=kv_heads,
            hidden_dim=hidden,
            rope=rope,
            attn_backend="flex",
        ),
    )
    model = _built(config)
    hf = _hf_config(
        "LlamaForCausalLM",
        "llama",
        **_dense(vocab, dim, hidden, layers, heads, kv_heads),
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    state = _seeded(model)
    return TitanModel(model, config, state, Llama3StateDictAdapter(config, None), hf)


def deepseek_v3(layers: int = 3, experts: int = 4) -> TitanModel:
    """Return a DeepSeek-V3 of ``layers`` layers (the first dense, the others MoE of ``experts`` routed experts).

    The router is DeepSeek-V3's as transformers' ``DeepseekV3TopkRouter`` computes it (it
    has no other): sigmoid scores, the top 2 chosen by score plus the expert bias,
    their weights normalised to sum 1 and scaled by 2.5, one expert group. torchtitan
    spells that ``router_score_func="sigmoid"``, ``router_route_norm=True``,
    ``router_route_scale=2.5`` and no ``router_num_expert_groups``; the config.json
    ``norm_topk_prob``, ``routed_scaling_factor`` and ``n_group = topk_group = 1``. Both
    rotate interleaved pairs (``rope_interleave``, torchtitan's ``ComplexRoPE``), unscaled,
    theta 10000, and normalise with eps 1e-5. The expert bias (a buffer torchtitan's
    load balancing moves, zero when built) is drawn too, so it steers the routing.
    """
    from torchtitan.models import deepseek_v3 as family
    from torchtitan.models.common import ComplexRoPE
    from torchtitan.models.deepseek_v3 import (
        DeepSeekV3Model,
        DeepSeekV3StateDictAdapter,
        _build_dsv3_layers,
    )

    dim, vocab, heads = 64, 128, 4
    config = DeepSeekV3Model.Config(
        **_ends(family, dim, vocab),
        layers=_build_dsv3_layers(
            n_layers=layers,
            n_dense_layers=1,
            dim=dim,
            n_heads=heads,
            q_lora_rank=0,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            mscale=0.70,
            dense_hidden_dim=96,
            moe_hidden_dim=32,
            num_experts=experts,
            num_shared_experts=1,
            router_top_k=2,
            router_score_func="sigmoid",
            router_route_norm=True,
            router_route_scale=2.5,
            attn_backend="flex",
            moe_comm_backend="standard",
            non_blocking_capacity_factor=None,
            rope=ComplexRoPE.Config(dim=8, max_seq_len=256, theta=10000.0, scaling="none"),
        ),
        mtp_layers=[],
    )
    model = _built(config)
    hf = _hf_config(
        "DeepseekV3ForCausalLM",
        "deepseek_v3",
        vocab_size=vocab,
        hidden_size=dim,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        n_shared_experts=1,
        n_routed_experts=experts,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        first_k_dense_replace=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_interleave=True,
        max_position_embeddings=256,
    )
    _seeded(model)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for block in model.layers.values():
            if block.moe_enabled:
                block.moe.expert_bias_E.copy_(torch.randn(experts, generator=gen) * 0.5)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return TitanModel(model, config, state, DeepSeekV3StateDictAdapter(config, None), hf)


def qwen3(layers: int = 2) -> TitanModel:
    """Return a dense Qwen 3 of ``layers`` layers: dim 64, 4 query heads of 16 over 2 key/value heads, untied."""
    from torchtitan.models import qwen3 as family
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import Qwen3Model, Qwen3StateDictAdapter, _build_qwen3_layers

    dim, vocab, heads, kv_heads, head_dim, hidden = 64, 128, 4, 2, 16, 96
    config = Qwen3Model.Config(
        vocab_size=vocab,
        dim=dim,
        norm=family._qwen3_norm(dim),
        enable_weight_tying=False,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab, embedding_dim=dim, param_init=family._EMBEDDING_INIT
        ),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=family._LINEAR_INIT),
        layers=_build_qwen3_layers(
            n_layers=layers,
            dim=dim,
            n_heads=heads,
            n_kv_heads=kv_heads,
            head_dim=head_dim,
            hidden_dim=hidden,
            attn_backend="flex",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=256, theta=1000000.0),
        ),
    )
    model = _built(config)
    hf = _hf_config(
        "Qwen3ForCausalLM",
        "qwen3",
        **_dense(vocab, dim, hidden, layers, heads, kv_heads),
        head_dim=head_dim,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=256,
    )
    state = _seeded(model)
    return TitanModel(model, config, state, Qwen3StateDictAdapter(config, None), hf)


def save(titan: TitanModel, root: Path, config: dict | None = None) -> tuple[Path, Path]:
    """Save ``titan``'s state as torchtitan's model-only step (``root/step-0``) and its config (``root/config``)."""
    step = root / "step-0"
    dcp.save(dict(titan.state), checkpoint_id=step, no_dist=True)
    (root / "config").mkdir()
    (root / "config" / "config.json").write_text(json.dumps(config or titan.hf_config))
    return step, root / "config"
