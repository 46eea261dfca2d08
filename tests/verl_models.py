"""The tiny Qwen2 of the veRL goldens, importable as ``--model verl_models:qwen2``."""

from __future__ import annotations

from pathlib import Path

from torch import nn

GOLDENS = Path(__file__).parent / "goldens" / "verl"
WRAP = "transformers.models.qwen2.modeling_qwen2:Qwen2DecoderLayer"
"""The class veRL's FSDP1 wrap policy wraps (the model's ``_no_split_modules``)."""


def qwen2() -> nn.Module:
    """Return the goldens' Qwen2ForCausalLM, built from the config veRL saved beside them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(GOLDENS / "fsdp1" / "global_step_2" / "huggingface")
    return AutoModelForCausalLM.from_config(config)
