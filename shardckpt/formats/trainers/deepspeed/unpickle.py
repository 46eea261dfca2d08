"""DeepSpeed's pickles read without DeepSpeed: stand-ins for the few classes they name.

A ZeRO optimizer file names three DeepSpeed classes besides torch's own: its loss
scaler (``LossScaler`` or ``DynamicLossScaler``, pickled as an object and its
``__dict__``), the ZeRO stage (``ZeroStageEnum``, pickled as a call with the stage
number) and the position of each parameter in a partition (``fragment_address``, a
dataclass). Each is loaded as a stand-in here, on torch's ``weights_only`` allow-list
under DeepSpeed's name, so nothing of DeepSpeed is imported and no pickle runs code:
the stand-ins keep plain values only, and refuse anything else.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from shardckpt.core.errors import UnsafePickleError
from shardckpt.formats.torch_save.in_place import load_in_place, load_object_in_place

LOSS_SCALERS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
)
ZERO_STAGE = "deepspeed.runtime.zero.config.ZeroStageEnum"
FRAGMENT_ADDRESS = "deepspeed.utils.tensor_fragment.fragment_address"
_PLAIN = (bool, int, float, str, type(None))


def _plain_state(state: object, what: str) -> dict:
    """Return ``state`` (an object's ``__dict__`` from a pickle) when it holds plain values only."""
    if not isinstance(state, dict) or not all(
        type(k) is str and isinstance(v, _PLAIN) for k, v in state.items()
    ):
        raise pickle.UnpicklingError(f"a {what} whose state is not a dict of plain values")
    return dict(state)


class LossScalerState:
    """A DeepSpeed loss scaler as saved: its attributes (``cur_scale``, ``dynamic``, ...)."""

    values: dict

    def __setstate__(self, state: object) -> None:
        # DynamicLossScaler keeps the dtype it scales; by name, so every output format holds it.
        if isinstance(state, dict):
            state = {k: str(v) if isinstance(v, torch.dtype) else v for k, v in state.items()}
        self.values = _plain_state(state, "loss scaler")


class FragmentAddress:
    """``fragment_address``: where a parameter's slice lies in one rank's flat partition."""

    numel: int
    start: int

    def __setstate__(self, state: object) -> None:
        values = _plain_state(state, "fragment_address")
        numel, start = values.get("numel"), values.get("start")
        if type(numel) is not int or type(start) is not int or numel < 0 or start < 0:
            raise pickle.UnpicklingError("a fragment_address without non-negative numel and start")
        self.numel, self.start = numel, start


def zero_stage(value: object) -> int:
    """Return the stage a pickled ``ZeroStageEnum(value)`` names (0 to 3)."""
    if type(value) is not int or not 0 <= value <= 3:
        raise pickle.UnpicklingError(f"ZeroStageEnum({value!r}), where a stage is 0 to 3")
    return value


def stand_ins() -> list:
    """Return the allow-list entries of a DeepSpeed pickle: each stand-in under DeepSpeed's name."""
    return [
        *((LossScalerState, name) for name in LOSS_SCALERS),
        (zero_stage, ZERO_STAGE),
        (FragmentAddress, FRAGMENT_ADDRESS),
    ]


@contextmanager
def _refusals_explained() -> Iterator[None]:
    """Give a refused DeepSpeed pickle the hint that fits what it named."""
    try:
        yield
    except UnsafePickleError as exc:
        exc.hint = _refusal_hint(exc.message)
        exc.args = (exc.line(),)
        raise


def load_file(path: Path) -> object:
    """Return the object in one DeepSpeed ``torch.save`` file, memory-mapped, DeepSpeed's classes as stand-ins.

    Always weights-only: with the stand-ins nothing in a DeepSpeed checkpoint needs
    ``--trust-pickle``, so a pickle they do not cover is refused whatever was passed. A
    URL SRC's file is loaded on the meta device, its tensors read by ranges
    (``torch_save.in_place.values``).
    """
    with _refusals_explained():
        return load_object_in_place(path, False, safe_globals=stand_ins())


def load_dict_file(path: Path) -> dict:
    """Return the dict in one DeepSpeed ``torch.save`` file (as ``load_file``); refuse any other top level.

    A URL SRC's file is loaded on the meta device, its tensors read by ranges
    (``torch_save.in_place.values``).
    """
    with _refusals_explained():
        return load_in_place(path, False, safe_globals=stand_ins())


def _refusal_hint(message: str) -> str:
    """Return what to do about a DeepSpeed file the weights-only loader refused, by what it named."""
    if "names deepspeed." in message:
        return (
            "shardckpt reads the DeepSpeed classes of releases up to 0.19.8 without running "
            "them, and this one is not among them (a newer DeepSpeed?)"
        )
    if "names " in message:
        return (
            "no DeepSpeed checkpoint names it, and shardckpt never runs a DeepSpeed "
            "checkpoint's pickle (not with --trust-pickle either); re-copy the checkpoint"
        )
    return "the file is not one DeepSpeed wrote, or was changed after; re-copy the checkpoint"
