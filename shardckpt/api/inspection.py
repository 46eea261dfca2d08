"""``inspect``: what a checkpoint holds, read from its metadata (no tensor data)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shardckpt.api import applies
from shardckpt.api.requests import InspectRequest, VerifyRequest
from shardckpt.api.source import open_checked
from shardckpt.api.storage import named, on_storage
from shardckpt.core.dist import Runtime
from shardckpt.core.errors import source_option
from shardckpt.core.progress import Progress
from shardckpt.core.words import counted
from shardckpt.formats import format_named
from shardckpt.formats.base import Index
from shardckpt.plan.selection import matches
from shardckpt.state.tree import (
    OptimizerInfo,
    describe_optimizer,
    find_optimizers,
    flat_hyperparameters,
    is_flat_optimizer,
    parse_flat,
    walk,
)

if TYPE_CHECKING:
    from shardckpt.api.integrity import Integrity


@dataclass
class Inspection:
    """What ``inspect`` found: the index, the leaves that pass the filter, optimizers, notes."""

    index: Index
    leaves: list[tuple[tuple, object]]
    optimizers: list[OptimizerInfo]
    warnings: list[str] = field(default_factory=list)
    components: list = field(default_factory=list)
    """A trainer's checkpoint: its parts (``formats.trainers.torchtitan.Component``), else empty."""
    integrity: Integrity | None = None
    """With ``verify``: what reading every byte found (``api.verify``)."""


@source_option("--from")
def inspect(
    request: InspectRequest, runtime: Runtime | None = None, progress: Progress | None = None
) -> Inspection:
    """Return the metadata of ``request.src``: leaves, layouts, optimizer subtrees.

    Reads no tensor data, unless ``request.verify`` asks for every byte to be checked.
    """
    runtime = runtime or Runtime()
    with on_storage(request, runtime) as run:
        return named(_inspect(run.request, runtime, progress), run)


def _inspect(request: InspectRequest, runtime: Runtime, progress: Progress | None) -> Inspection:
    flat_model = None
    if request.model:  # fsdp1-local's flat parameters, from the module built: torch
        from shardckpt.formats.fsdp1.flat_layout import FlatModel

        flat_model = FlatModel(request.model, tuple(request.wraps))

    def read_index() -> tuple[Index, list[str]]:
        choice = applies.Choice(
            src_format=request.format, model=request.model, wraps=tuple(request.wraps)
        )
        reader = open_checked(
            request.src,
            request.format,
            applies.INSPECT_RULES,
            choice,
            trust_pickle=request.trust_pickle,
            flat_model=flat_model,
        )
        return reader.index(), reader.notes()

    index, notes = runtime.agreed(read_index)
    leaves = [(p, leaf) for p, leaf in walk(index.tree) if matches(p, request.filters)]
    optimizers = [describe_optimizer(index.tree, p) for p in find_optimizers(index.tree)]
    parts = format_named(index.format).components
    checked = None
    if request.verify:
        from shardckpt.api.integrity import verify  # reading every byte: the scan's modules

        asked = VerifyRequest(
            src=request.src, format=index.format, trust_pickle=request.trust_pickle
        )
        checked = verify(asked, runtime, progress)
    return Inspection(
        index,
        leaves,
        optimizers,
        notes + _optimizer_warnings(index.tree, optimizers),
        parts(index.tree) if parts is not None else [],
        checked,
    )


def _optimizer_warnings(tree: dict, optimizers: list[OptimizerInfo]) -> list[str]:
    """Return notes on optimizer state that names no parameter, and parameters with no state."""
    notes = []
    for info in optimizers:
        node = tree
        for p in info.path:
            node = node[p]
        if is_flat_optimizer(node):
            state, params = _flat_listing(node)
        else:
            state = node.get("state", {}) if isinstance(node.get("state"), dict) else {}
            params = [
                p
                for g in node.get("param_groups", [])
                if isinstance(g, dict)
                for p in g.get("params", [])
            ]
        listed = {str(p) for p in params}
        stray = [k for k in state if str(k) not in listed]
        if params and stray:
            notes.append(
                f"{'.'.join(map(str, info.path))}: state for {counted(len(stray), 'key')} in no param group, "
                f"e.g. {stray[0]!r}"
            )
        keyed = {str(k) for k in state}
        stateless = [p for p in params if p not in state and str(p) not in keyed]
        if state and stateless:
            notes.append(
                f"{'.'.join(map(str, info.path))}: {counted(len(stateless), 'parameter')} without state yet, "
                f"e.g. {stateless[0]!r}"
            )
    return notes


def _flat_listing(node: dict) -> tuple[dict, list[str]]:
    """Return a flattened optimizer's state keys (by FQN, or the whole key) and its parameters."""
    parsed = parse_flat(node)
    state = {
        p.fqn if p.fqn is not None else key: None
        for key, p in parsed.items()
        if p.section == "state"
    }
    return state, list(flat_hyperparameters(node, parsed))
