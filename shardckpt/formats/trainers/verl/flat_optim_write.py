"""veRL's FSDP1 optimizer files at M: rank r's ``optimizer.state_dict()`` of flat-parameter slices.

For target rank r, each FSDP unit's flat parameter (``shardckpt.formats.fsdp1.flat_layout`` at (M, r))
is one param ID, numbered group by group in the units' order, as the optimizer over
``FSDP(model).parameters()`` numbers them. Its per-parameter state is r's padded shard of
the unit's flat state: the elements of each parameter that fall in it, filled from that
parameter's FQN-keyed state, the padding left zero (what FSDP1's own optimizer holds
there: the padding never has a gradient); its ``step`` is the unit's first parameter's.
"""

from __future__ import annotations

import torch

from shardckpt.codecs.zip_skeleton import fake_mode
from shardckpt.core.errors import UsageError
from shardckpt.formats.fsdp1.flat_layout import FlatLayout
from shardckpt.formats.fsdp1.writer import flat_fills
from shardckpt.formats.ranks.rank_file import Fills, placeholder_whole
from shardckpt.formats.torch_save.file import storage_of
from shardckpt.state.tree import TensorMeta


def unit_ids(optim: dict, layouts: list[FlatLayout]) -> tuple[list[int], list[list[int]]]:
    """Return each unit's param ID and each group's IDs; refuse a unit split over groups."""
    group_of: dict[str, int] = {
        f: g for g, group in enumerate(optim["param_groups"]) for f in group["params"]
    }
    groups: list[list[int]] = [[] for _ in optim["param_groups"]]
    units: list[tuple[int, int]] = []
    for u, lay in enumerate(layouts):
        found = {group_of.get(lay.prefix + f) for f in lay.fqns}
        if len(found) != 1 or None in found:
            raise UsageError(
                f"FSDP1 flattens the parameters of unit '{lay.prefix or '<root>'}' into one, "
                "so they must all be in one param group of the optimizer, and they are not",
                hint="check --model/--wrap against the job, or write --format verl (FSDP2)",
            )
        units.append((found.pop(), u))  # type: ignore[arg-type]
    ids = [0] * len(layouts)
    for pid, (g, u) in enumerate(sorted(units)):
        ids[u] = pid
        groups[g].append(pid)
    return ids, groups


def flat_state(optim: dict, lay: FlatLayout, rank: int, fills: Fills) -> dict:
    """Return target rank ``rank``'s state of ``lay``'s flat parameter, in placeholders noted in ``fills``."""
    state = optim["state"]
    entries = [state.get(lay.prefix + f, {}) for f in lay.fqns]
    names = list(dict.fromkeys(n for e in entries for n in e))
    valid = max(0, min(lay.shard_numel, lay.unpadded_numel - rank * lay.shard_numel))
    out: dict = {}
    with fake_mode():
        for name in names:
            metas = [e.get(name) for e in entries]
            first = next(m for m in metas if m is not None)
            if not isinstance(first, TensorMeta):
                out[name] = first
            elif not first.shape:
                out[name] = placeholder_whole(fills, first)
            else:
                if any(m is None for m in metas):
                    raise UsageError(
                        f"parameters of unit '{lay.prefix or '<root>'}' differ in their "
                        f"optimizer state ({name!r} is missing for some), which one flat "
                        "parameter's state cannot hold",
                        hint="write --format verl (FSDP2)",
                    )
                flat = torch.empty(lay.shard_numel, dtype=first.dtype)
                fills[storage_of(flat)] = flat_fills(metas, lay, rank, valid)
                out[name] = flat
    return out
