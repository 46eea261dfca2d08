"""Ground truth for the product's tests: checkpoints and loads done by torch itself.

Everything here runs real FSDP2 (``fully_shard``) and DCP on gloo ranks through
``harness.run_ranks``; the model, optimizer and training loop are the ones in
``examples/make_checkpoint.py`` (``example`` below), so what users run is what is tested.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from harness import run_ranks
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

EXAMPLE_PATH = Path(__file__).resolve().parents[1] / "examples" / "make_checkpoint.py"

# Loaders build the model from another seed than the checkpoint's, so a load that
# silently does nothing cannot pass a comparison with the reference.
_LOAD_SEED = 1234


def _load_example() -> ModuleType:
    """Return examples/make_checkpoint.py imported as module ``make_checkpoint``."""
    if "make_checkpoint" in sys.modules:
        return sys.modules["make_checkpoint"]
    spec = importlib.util.spec_from_file_location("make_checkpoint", EXAMPLE_PATH)
    assert spec is not None and spec.loader is not None, EXAMPLE_PATH
    module = importlib.util.module_from_spec(spec)
    # Registered before exec so that its classes pickle as make_checkpoint.TinyLM.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


example = _load_example()


@dataclass(frozen=True, slots=True)
class Fsdp2Checkpoint:
    """A DCP checkpoint written by FSDP2 training and its full-state reference."""

    dcp: Path
    """The DCP directory (``.metadata`` + ``*.distcp``) holding ``{"model", "optim"}``."""
    ref: Path
    """``torch.save`` of the same state gathered to full tensors on rank 0."""
    world_size: int
    """The number of ranks that trained and saved it."""


def _make_on_rank(out_dir: str, ref_path: str, steps: int, seed: int) -> None:
    """Train and save on this rank (runs under ``run_ranks``)."""
    example.make_checkpoint(out_dir, steps=steps, seed=seed, full_ref=ref_path)


def make_fsdp2_dcp(
    out_dir: str | os.PathLike,
    ref_path: str | os.PathLike,
    world_size: int = 4,
    steps: int = 2,
    seed: int = 0,
) -> Fsdp2Checkpoint:
    """Train the example model with FSDP2 on ``world_size`` ranks; return its checkpoints."""
    run_ranks(_make_on_rank, world_size, os.fspath(out_dir), os.fspath(ref_path), steps, seed)
    return Fsdp2Checkpoint(Path(out_dir), Path(ref_path), world_size)


def _load_on_rank(dcp_dir: str, build_optimizer=None) -> dict[str, Any] | None:
    """Resume from ``dcp_dir`` as training does; return the full state on rank 0.

    ``build_optimizer(model)`` makes the optimizer (default: the example's).
    """
    model = example.shard_model(example.build_model(_LOAD_SEED), dist.get_world_size())
    optimizer = (build_optimizer or example.build_optimizer)(model)
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    # dcp.load fills DTensor shards in place but replaces non-tensor values (param
    # group hyper-parameters) in the dicts, so read them back from `state`.
    dcp.load(state, checkpoint_id=dcp_dir)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd_full, osd_full = get_state_dict(model, optimizer, options=options)
    return {"model": msd_full, "optim": osd_full} if dist.get_rank() == 0 else None


def load_dcp_into_fsdp2(
    dcp_dir: str | os.PathLike, world_size: int, build_optimizer=None
) -> dict[str, Any]:
    """Return ``{"model", "optim"}`` full state after FSDP2 at ``world_size`` loads ``dcp_dir``."""
    return run_ranks(_load_on_rank, world_size, os.fspath(dcp_dir), build_optimizer)[0]


def _load_model_on_rank(dcp_dir: str) -> dict[str, Any] | None:
    """Start training from model weights alone (no optimizer state); return them on rank 0."""
    model = example.shard_model(example.build_model(_LOAD_SEED), dist.get_world_size())
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=dcp_dir)
    set_model_state_dict(model, state["model"])
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd_full = get_model_state_dict(model, options=options)
    return msd_full if dist.get_rank() == 0 else None


def load_dcp_model_into_fsdp2(dcp_dir: str | os.PathLike, world_size: int) -> dict[str, Any]:
    """Return the full model state after FSDP2 at ``world_size`` loads ``{"model"}`` from ``dcp_dir``."""
    return run_ranks(_load_model_on_rank, world_size, os.fspath(dcp_dir))[0]


def dcp_to_torch_save_reference(dcp_dir: str | os.PathLike, out_pt: str | os.PathLike) -> Path:
    """Write ``dcp_dir`` as one ``torch.save`` file with torch's own converter; return it."""
    dcp_to_torch_save(dcp_dir, out_pt)
    return Path(out_pt)


# Same-width integer views make the comparison bitwise: NaNs with equal payloads
# match, and 0.0 differs from -0.0.
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _fmt(path: tuple[Any, ...]) -> str:
    """Return a path as ``['optim']['state']['embed.weight']``, or ``<root>``."""
    return "".join(f"[{key!r}]" for key in path) or "<root>"


def _tensor_diff(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """Return why two plain tensors are not bit-identical, or None when they are."""
    from torch.distributed.tensor import DTensor

    if isinstance(a, DTensor) or isinstance(b, DTensor):
        return "DTensor: gather to full tensors before comparing"
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    bits_a, bits_b = a, b
    if a.is_complex():  # no 128-bit integer type: compare real and imaginary parts
        bits_a, bits_b = torch.view_as_real(a), torch.view_as_real(b)
    if a.dtype != torch.bool:
        int_dtype = _INT_VIEW[bits_a.element_size()]
        bits_a, bits_b = bits_a.view(int_dtype), bits_b.view(int_dtype)
    unequal = bits_a != bits_b
    if not unequal.any():
        return None
    first = tuple(torch.nonzero(unequal)[0].tolist())[: a.ndim]
    return (
        f"{int(unequal.sum())} of {unequal.numel()} elements differ, first at {first}: "
        f"{a[first].item()!r} vs {b[first].item()!r}"
    )


def _diff(a: Any, b: Any, path: tuple[Any, ...], out: list[str]) -> None:
    """Append to ``out`` one line per difference between ``a`` and ``b`` under ``path``."""
    where = _fmt(path)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if (why := _tensor_diff(a, b)) is not None:
            out.append(f"{where}: {why}")
    elif isinstance(a, dict) and isinstance(b, dict):
        # dict vs OrderedDict and key order are not compared: state_dict() returns an
        # OrderedDict and get_state_dict a dict for the same content.
        for key in a.keys() - b.keys():
            out.append(f"{where}: key {key!r} only in the first tree")
        for key in b.keys() - a.keys():
            out.append(f"{where}: key {key!r} only in the second tree")
        for key in a.keys() & b.keys():
            _diff(a[key], b[key], (*path, key), out)
    elif type(a) is not type(b):
        out.append(f"{where}: {type(a).__name__} {a!r} vs {type(b).__name__} {b!r}")
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b):
            out.append(f"{where}: length {len(a)} vs {len(b)}")
        for i, (x, y) in enumerate(zip(a, b)):
            _diff(x, y, (*path, i), out)
    elif isinstance(a, float):
        if a.hex() != b.hex() and not (math.isnan(a) and math.isnan(b)):
            out.append(f"{where}: {a!r} vs {b!r}")
    elif a != b:
        out.append(f"{where}: {a!r} vs {b!r}")


def assert_trees_equal(a: Any, b: Any, max_lines: int = 20) -> None:
    """Raise AssertionError naming every path where ``a`` and ``b`` are not bit-identical."""
    out: list[str] = []
    _diff(a, b, (), out)
    if out:
        shown = "\n  ".join(sorted(out)[:max_lines])
        more = f"\n  ... and {len(out) - max_lines} more" if len(out) > max_lines else ""
        raise AssertionError(f"trees differ at {len(out)} paths:\n  {shown}{more}")


def write_hf_like_transformers(path, tensors: dict, per_shard: int) -> None:
    """Write ``tensors`` as transformers' save_pretrained lays them out (the library, not ours)."""
    from safetensors.torch import save_file

    path.mkdir()
    names = list(tensors)
    groups = [names[i : i + per_shard] for i in range(0, len(names), per_shard)]
    weight_map = {}
    for i, group in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in group}, path / file, {"format": "pt"})
        weight_map.update(dict.fromkeys(group, file))
    total = sum(t.nbytes for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(
        json.dumps(index, indent=2, sort_keys=True) + "\n"
    )
