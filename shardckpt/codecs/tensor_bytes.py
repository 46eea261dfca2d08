"""A tensor's raw bytes, as the writers and the collective move them."""

from __future__ import annotations

from shardckpt.core.lazy_torch import torch


def contiguous_bytes(tensor: torch.Tensor) -> memoryview:
    """Return the raw bytes of ``tensor`` (on CPU, contiguous) without copying when possible."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def cast_bytes(data: memoryview, source: torch.dtype, target: torch.dtype) -> memoryview:
    """Return the raw bytes of the ``source``-dtype elements in ``data``, cast to ``target``."""
    if not len(data):
        return data
    # A copy: ``frombuffer`` of read-only bytes warns, and the cast makes new ones anyway.
    return contiguous_bytes(torch.frombuffer(bytearray(data), dtype=source).to(target))
