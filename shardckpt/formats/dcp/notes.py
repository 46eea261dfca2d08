"""What a DCP DST's tree is told: a flat state dict, where training loaders expect ``{"model": ...}``."""

from __future__ import annotations

from shardckpt.state.tree import TensorMeta


def flat_tree_notes(tree: dict, _world_size: int) -> list[str]:
    """Return the note for a tree of tensors at its root (``model.state_dict()`` saved flat)."""
    if not tree or not all(isinstance(v, TensorMeta) for v in tree.values()):
        return []
    return [
        "DST holds the FQNs at its root, as SRC does; dcp.load({'model': "
        "model.state_dict()}) and trainers' loaders look for them under 'model': pass "
        "--nest model for that"
    ]
