"""FSDP1 flat-parameter layouts, as FSDP1 itself computes them, for any world size and rank.

The user's model is built under ``FakeTensorMode`` (no memory), wrapped in FSDP1 as
training did (``ModuleWrapPolicy`` of the ``--wrap`` classes, ``use_orig_params``)
against a ``FakeProcessGroup`` of the target size and rank (a process group that only
knows its rank and size), and each unit's ``FlatParameter`` metadata is read back:
which parameters it holds and in what order, the alignment padding between them, tied
aliases and this rank's shard (``torch_internals.flat_param_info``: FSDP1 keeps these
in private fields). Nothing of FSDP's flattening is re-implemented here.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

import torch
from torch import nn

from shardckpt.core.errors import UsageError
from shardckpt.core.torch_internals import (
    FSDP1_LAYOUTS,
    fake_process_group,
    fake_tensor_mode,
    flat_param_info,
    flat_param_of,
)
from shardckpt.state.model import load_factory
from shardckpt.state.tree import clean_fqn

FLAT_PARAM = "_flat_param"


@dataclass(frozen=True)
class ShardPiece:
    """Where one parameter sits in a rank's flat shard (FSDP's ``_ShardParamInfo``)."""

    in_shard: bool
    offset_in_shard: int
    numel_in_shard: int


@dataclass(frozen=True)
class FlatLayout:
    """One FSDP unit's ``FlatParameter`` at a world size, seen from one rank."""

    prefix: str
    """The unit's clean FQN prefix: ``""`` for the root, ``"blocks.0."`` for a block."""
    fqns: tuple[str, ...]
    """Parameter FQNs relative to the unit, in flat order."""
    shapes: tuple[tuple[int, ...], ...]
    numels_with_padding: tuple[int, ...]
    is_padding: tuple[bool, ...]
    shard_numel: int
    """Elements of each rank's padded shard (every rank's is the same size)."""
    shard_numel_padded: int
    """Padding elements at the end of this rank's shard."""
    pieces: tuple[ShardPiece, ...]
    """Per parameter, its part of this rank's shard."""
    shared: tuple[tuple[str, str], ...]
    """Tied aliases: ``(alias FQN, FQN of the parameter it shares)``, relative to the unit."""
    use_orig_params: bool = False

    @property
    def unpadded_numel(self) -> int:
        """Return the elements of the flat parameter without the tail padding (with alignment)."""
        return sum(self.numels_with_padding)

    def starts(self) -> dict[str, int]:
        """Return each parameter's first element in the unsharded flat parameter."""
        out, pos, i = {}, 0, 0
        for numel, pad in zip(self.numels_with_padding, self.is_padding):
            if not pad:
                out[self.fqns[i]] = pos
                i += 1
            pos += numel
        return out

    def padding(self, world_size: int) -> int:
        """Return every padding element of the flat parameter over ``world_size`` ranks."""
        return self.shard_numel * world_size - sum(prod(s) for s in self.shapes)


@dataclass(frozen=True)
class FlatModel:
    """What ``--model`` and ``--wrap`` name: the model factory and FSDP1 wrap classes."""

    spec: str
    wraps: tuple[str, ...] = ()


def _wrap_classes(wraps: Sequence[str]) -> set[type]:
    classes = set()
    for spec in wraps:
        try:
            cls = load_factory(spec)
        except UsageError as exc:
            raise UsageError(exc.message.replace("--model", "--wrap"), hint=exc.hint) from None
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise UsageError(
                f"--wrap {spec!r} is not an nn.Module class",
                hint="pass --wrap pkg.module:Class, a class FSDP1's ModuleWrapPolicy wrapped",
            )
        classes.add(cls)
    return classes


def flat_layouts(
    model: FlatModel, world_size: int, rank: int, use_orig_params: bool
) -> list[FlatLayout]:
    """Return the flat parameters FSDP1 makes of ``model`` on ``rank`` of ``world_size``, outermost first."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    factory = load_factory(model.spec)
    classes = _wrap_classes(model.wraps)
    with warnings.catch_warnings(), fake_tensor_mode(FSDP1_LAYOUTS):
        warnings.simplefilter("ignore")
        try:
            built = factory()
        except Exception as exc:  # noqa: BLE001 - the user's code: report it in one line
            raise UsageError(
                f"--model {model.spec!r} failed ({type(exc).__name__}: {exc})",
                hint="the factory must build the model without arguments",
            ) from None
        module = built[0] if isinstance(built, tuple) else built
        if not isinstance(module, nn.Module):
            raise UsageError(
                f"--model {model.spec!r} returned {type(module).__name__}, not an nn.Module",
                hint="pass --model pkg.module:factory returning the model",
            )
        wrapped = FSDP(
            module,
            process_group=fake_process_group(rank, world_size),
            auto_wrap_policy=ModuleWrapPolicy(classes) if classes else None,
            use_orig_params=use_orig_params,
            device_id=torch.device("cpu"),
        )
    out = []
    for name, sub in wrapped.named_modules():
        fp = flat_param_of(sub) if isinstance(sub, FSDP) else None
        if fp is None:
            continue
        info = flat_param_info(fp)
        prefix = clean_fqn(f"{name}.") if name else ""
        out.append(
            FlatLayout(
                prefix=prefix,
                fqns=info.fqns,
                shapes=info.shapes,
                numels_with_padding=info.numels_with_padding,
                is_padding=info.is_padding,
                shard_numel=int(fp.numel()),
                shard_numel_padded=info.shard_numel_padded,
                pieces=tuple(
                    ShardPiece(i.in_shard, i.offset_in_shard or 0, i.numel_in_shard or 0)
                    for i in info.shard_param_infos
                ),
                shared=tuple(
                    (
                        _join(s.module_name, s.param_name),
                        _join(s.prim_module_name, s.prim_param_name),
                    )
                    for s in info.shared_param_infos
                ),
                use_orig_params=use_orig_params,
            )
        )
    return out


def _join(module_name: str, param_name: str) -> str:
    return f"{module_name}.{param_name}" if module_name else param_name
