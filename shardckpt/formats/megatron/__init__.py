"""``megatron``: megatron-core ``dist_checkpointing`` directories saved with the ``torch_dist`` backend.

Read (``reader.py``) as one tree, the DCP data and ``common.pt``'s values; written at
any world size M (``writer.py``) as a directory ``dist_checkpointing.load`` takes.
``inspect`` says what each chunk is (``layouts.py``): stacked layers, tensor-parallel
pieces. Detected by its ``common.pt`` or ``metadata.json`` beside DCP's ``.metadata`` (``config.py``).
"""

from __future__ import annotations

from shardckpt.formats.megatron.config import CONFIG_FILE, looks_like
from shardckpt.formats.megatron.reader import MegatronReader
from shardckpt.formats.megatron.writer import MegatronWriter

__all__ = ["CONFIG_FILE", "MegatronReader", "MegatronWriter", "looks_like"]
