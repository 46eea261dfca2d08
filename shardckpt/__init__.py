"""shardckpt: convert PyTorch training checkpoints between layouts, formats and world sizes."""

from __future__ import annotations

__version__ = "0.1.0"
