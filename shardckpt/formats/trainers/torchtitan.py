"""``torchtitan``: a ``step-N`` directory torchtitan's ``CheckpointManager`` saved, a DCP directory.

What torchtitan 0.3 saves (``components/checkpointer/dcp.py``, ``_flattened_model_states_sd``):
the model's state dict merged into the top level (its FQNs are top-level keys, no
``model`` prefix), and beside it one key per other state: ``optimizer`` (the optimizer
container's state, flattened: ``state.<fqn>.<name>``, ``param_groups.<fqn>.<hyper>``),
``lr_scheduler`` (``{"last_epoch": N}``), ``dataloader`` (``{"dp_rank_R": pickled
bytes, "world_size": N}`` for each data-parallel rank R, or None without a stateful
loader) and ``train_state`` (the trainer's ``{"step", "ntokens_seen"}``). A model-only
save (step 0, or the last step with ``last_save_model_only``) is the FQNs alone: a plain
``dcp`` checkpoint.

Reading is DCP's (``DcpReader``); writing is ``DcpWriter``'s, at any M, after
``titan_tree`` checked that the tree is one torchtitan loads (and flattened a nested
optimizer). Everything but tensors is carried as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from shardckpt.core.errors import UsageError
from shardckpt.core.words import counted
from shardckpt.formats.dcp.reader import METADATA_FILE, DcpReader, is_dcp_dir, read_metadata
from shardckpt.state.optim import RekeyError, flatten, key_type
from shardckpt.state.tree import (
    FLAT_GROUPS,
    FLAT_STATE,
    dotted,
    find_optimizers,
    is_nested_optimizer,
    is_tensor_leaf,
)

OPTIMIZER = "optimizer"
LR_SCHEDULER = "lr_scheduler"
DATALOADER = "dataloader"
TRAIN_STATE = "train_state"
_PARTS = (OPTIMIZER, LR_SCHEDULER, DATALOADER, TRAIN_STATE)
_DP_RANK = "dp_rank_"


def looks_like(src: Path) -> bool:
    """Return whether the DCP directory ``src`` holds torchtitan's parts beside the model.

    Told from ``.metadata`` alone: a flattened optimizer under ``optimizer`` and an
    ``lr_scheduler`` or ``train_state`` beside it. Metadata that cannot be read safely
    says no: the DCP reader then reports why.
    """
    if not is_dcp_dir(src):
        return False
    try:
        md = read_metadata(src, trust_pickle=False)
    except Exception:
        return False
    paths = list((md.planner_data or {}).values())
    flat_optimizer = any(
        len(p) == 2 and p[0] == OPTIMIZER and str(p[1]).startswith((FLAT_STATE, FLAT_GROUPS))
        for p in paths
    )
    return flat_optimizer and any(p and p[0] in (LR_SCHEDULER, TRAIN_STATE) for p in paths)


class TorchtitanReader(DcpReader):
    """Reads a torchtitan ``step-N`` directory: DCP's reader, named for the format."""

    format = "torchtitan"


@dataclass(frozen=True)
class Component:
    """One part of a trainer's checkpoint: its name, what it is, and a note for the user."""

    name: str
    kind: str
    """``model``, ``optimizer (flat)``, ``values`` or ``tensors``."""
    keys: tuple[str, ...]
    """The top-level keys it is saved under."""
    note: str = ""


def components(tree: Mapping) -> list[Component]:
    """Return the parts of a torchtitan tree: the model (top-level tensors), then each state."""
    model = tuple(k for k, v in tree.items() if k not in _PARTS and is_tensor_leaf(v))
    out = [Component("model", "model", model, f"{len(model)} tensors at the top level")]
    for name in [k for k in tree if k not in model]:
        node = tree[name]
        if name == OPTIMIZER and isinstance(node, Mapping) and find_optimizers(node) == [()]:
            out.append(Component(name, f"optimizer ({key_type(node)})", (name,)))
        elif name == DATALOADER and isinstance(node, Mapping):
            out.append(Component(name, "values", (name,), dataloader_note(node)))
        else:
            kind = "values" if not _holds_tensors(node) else "tensors"
            out.append(Component(name, kind, (name,)))
    return out


def _holds_tensors(node: object) -> bool:
    if is_tensor_leaf(node):
        return True
    if isinstance(node, Mapping):
        return any(_holds_tensors(v) for v in node.values())
    return False


def dataloader_note(node: Mapping) -> str:
    """Return what a torchtitan dataloader state says about the world size it belongs to."""
    ranks = sorted(k for k in node if isinstance(k, str) and k.startswith(_DP_RANK))
    size = node.get("world_size")
    of = counted(size, "data-parallel rank") if isinstance(size, int) else "data-parallel ranks"
    return (
        f"per-rank state of {of} ({', '.join(ranks)}); torchtitan loads it only at that "
        "data-parallel degree"
    )


def titan_tree(tree: dict, src: str) -> dict:
    """Return ``tree`` as torchtitan loads it; refuse one it would load wrongly or not at all.

    torchtitan looks its optimizer up under ``optimizer`` in the flattened form (a
    nested FQN-keyed one is flattened here), and the model's FQNs at the top level:
    its model wrapper loads with ``strict=False``, so a model under a ``model`` key
    would load nothing and say nothing.
    """
    model = tree.get("model")
    if isinstance(model, Mapping) and _holds_tensors(model) and not is_nested_optimizer(model):
        raise UsageError(
            "holds its model state under 'model', and torchtitan loads model FQNs from the "
            "top level (its loader would silently skip them)",
            path=src,
            hint="write --format dcp, or convert a checkpoint torchtitan saved",
        )
    out = dict(tree)
    for path in find_optimizers(tree):
        if path != (OPTIMIZER,):
            raise UsageError(
                f"has an optimizer at '{dotted(path) or '(top level)'}', and torchtitan "
                f"loads its optimizer from '{OPTIMIZER}' only",
                path=src,
                hint="write --format dcp, or convert a checkpoint torchtitan saved",
            )
        optim = tree[OPTIMIZER]
        kind = key_type(optim)
        if kind == "id":
            raise UsageError(
                "has an optimizer keyed by param ID, and torchtitan loads the flattened form",
                path=src,
                hint="add --optim-keys flat",
            )
        if kind in ("fqn", "empty"):
            try:
                out[OPTIMIZER] = flatten(optim)
            except RekeyError as exc:
                raise UsageError(
                    f"cannot flatten its optimizer for torchtitan: {exc}", path=src
                ) from None
    return out


def world_size_notes(tree: Mapping, world_size: int) -> list[str]:
    """Return notes on parts of ``tree`` that torchtitan at ``world_size`` will not take as they are."""
    node = tree.get(DATALOADER)
    size = node.get("world_size") if isinstance(node, Mapping) else None
    if not isinstance(size, int) or size == world_size:
        return []
    return [
        f"'{DATALOADER}' holds the data loader state of {counted(size, 'data-parallel rank')}, "
        "carried unchanged: torchtitan does not reshard data loaders, "
        f"so where the data-parallel degree at {world_size} ranks differs, resume with "
        f"--checkpoint.exclude_from_loading {DATALOADER}"
    ]


__all__ = ["METADATA_FILE", "TorchtitanReader", "components", "looks_like", "titan_tree"]
