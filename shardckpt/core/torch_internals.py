"""torch's private names that shardckpt uses, each looked up here, with what happens without it.

torch's public API does not reach all that a conversion needs: where DCP stored a chunk's
bytes, a device mesh for rank r of M outside a job of M, FSDP1's flat-parameter layout,
the names torch writes into its own files. Each such name is looked up here, when first
used, so that a torch release that renames or drops one neither stops shardckpt from
starting nor changes a byte of its output: the conversion that needs the name takes a
public path to the same result, or stops with one line naming the torch release
(``UnsupportedTorchError``, exit 2). shardckpt is tested on torch 2.13 and 2.15.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shardckpt.core.errors import UnsupportedTorchError
from shardckpt.core.lazy_torch import torch

TESTED_TORCH = "torch>=2.11,<2.16"
"""The torch releases shardckpt is tested with (pyproject's requirement)."""

# What each group of names is for, as the error says it: "..., which NEED".
WRITE_TORCH_FILES = "writing torch.save files needs"
WRITE_DTENSORS = "writing DTensors for other ranks needs"
READ_FSDP2_RANKS = "reading fsdp2-ranks files needs"
FSDP1_LAYOUTS = "FSDP1's flat-parameter layouts (fsdp1-local) need"
SHARDED_TENSORS = "FSDP1's ShardedTensor files (fsdp1-sharded) need"
DCP_METADATA = "DCP's .metadata needs"


def unsupported(what: str, need: str) -> UnsupportedTorchError:
    """Return the error for a torch without ``what``, which ``need`` (a phrase ending in "need(s)")."""
    return UnsupportedTorchError(
        f"torch {torch.__version__} has no {what}, which {need}",
        hint=f"install a torch release shardckpt is tested with ({TESTED_TORCH})",
    )


def lookup(module: str, name: str) -> Any | None:
    """Return torch's ``module.name`` (``name`` may be dotted), or None where this torch has none."""
    try:
        found: Any = importlib.import_module(module)
    except ImportError:
        return None
    for part in name.split("."):
        found = getattr(found, part, None)
        if found is None:
            return None
    return found


def private(module: str, name: str, need: str) -> Any:
    """Return torch's private ``module.name``; raise ``unsupported`` where this torch has none."""
    found = lookup(module, name)
    if found is None:
        raise unsupported(f"{module}.{name}", need)
    return found


def fake_tensor_mode(need: str = WRITE_TORCH_FILES) -> Any:
    """Return a new ``FakeTensorMode``: tensors under it have a shape and dtype but no memory."""
    return private("torch._subclasses.fake_tensor", "FakeTensorMode", need)()


def default_store() -> Any | None:
    """Return the key-value store the default process group was made with, or None.

    Under torchrun it is the agent's, so it outlives any rank. None where this torch has
    no ``_get_default_store`` or no group is up: the ranks then learn nothing through it.
    """
    found = lookup("torch.distributed.distributed_c10d", "_get_default_store")
    try:
        return found() if found is not None else None
    except Exception:  # noqa: BLE001 - no group (torch raises ValueError or RuntimeError)
        return None


# --- torch.save's storage bookkeeping, mirrored by zip_skeleton --------------------------


def storage_key(storage: Any) -> int:
    """Return the identity ``torch.save`` gives a storage (``_cdata``, its C++ object's address)."""
    key = getattr(storage, "_cdata", None)
    if not isinstance(key, int):
        raise unsupported("UntypedStorage._cdata", WRITE_TORCH_FILES)
    return key


def untyped_storage(storage: Any) -> Any:
    """Return the ``UntypedStorage`` under a ``TypedStorage``, the one ``torch.save`` records."""
    found = getattr(storage, "_untyped_storage", None)
    if found is None:
        raise unsupported("TypedStorage._untyped_storage", WRITE_TORCH_FILES)
    return found


def is_placeholder(storage: Any) -> bool:
    """Return whether ``torch.save`` under ``skip_data`` records ``storage`` as a fake tensor's.

    It tells them by the device a fake storage stands for (``_fake_device``).
    """
    if not hasattr(torch.storage._StorageBase, "_fake_device"):
        raise unsupported("torch.storage._StorageBase._fake_device", WRITE_TORCH_FILES)
    return getattr(storage, "_fake_device", None) is not None


def stored_offset(storage: Any) -> int | None:
    """Return where in its ``torch.save`` zip a storage loaded on the meta device lies.

    None where this torch does not say (``_checkpoint_offset``): the caller reads the
    data another way.
    """
    offset = getattr(storage, "_checkpoint_offset", None)
    return offset if isinstance(offset, int) and not isinstance(offset, bool) else None


# --- DTensor placements and device meshes ------------------------------------------------


def strided_shard() -> type | None:
    """Return torch's ``_StridedShard`` placement (FSDP+TP's), or None where this torch has none."""
    return lookup("torch.distributed.tensor.placement_types", "_StridedShard")


def missing_safe_globals() -> list[type]:
    """Return torch's own DTensor classes a rank file may name that this torch's allow-list lacks.

    torch 2.12 put ``_StridedShard`` on ``weights_only``'s allow-list beside ``Shard``;
    2.11 refuses every FSDP+TP rank file without it. Like ``Shard`` it is a
    placement holding two ints (``dim``, ``split_factor``), built by setting them.
    """
    import torch.distributed.tensor  # noqa: F401 - puts DTensor's classes on the allow-list

    allowed = torch.serialization.get_safe_globals()
    found = [strided_shard()]
    return [c for c in found if c is not None and c not in allowed]


def local_chunk(dtensor: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Return ``(sizes, offsets)``: the part of the global tensor a DTensor's local shard holds.

    torch's ``compute_local_shape_and_global_offset`` where it has one; else the chunk
    the DTensor reports to DCP (``__create_chunk_list__``), which torch computes with that
    function, for any DTensor but a Partial one.
    """
    compute = lookup("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset")
    if compute is not None:
        sizes, offsets = compute(dtensor.shape, dtensor.device_mesh, dtensor.placements)
    else:
        if any(p.is_partial() for p in dtensor.placements):
            raise unsupported(
                "torch.distributed.tensor._utils.compute_local_shape_and_global_offset",
                "a Partial DTensor's local shape needs",
            )
        (chunk,) = dtensor.__create_chunk_list__()
        sizes, offsets = chunk.sizes, chunk.offsets
    return tuple(int(s) for s in sizes), tuple(int(o) for o in offsets)


def shard_chunk(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: list[int],
    placements: Sequence[str],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Return ``(sizes, offsets)`` of the chunk the rank at ``coordinate`` holds, DTensor's way.

    ``placements`` are labels, ``Shard(d)`` or ``Replicate``, one per mesh dimension.
    """
    from torch.distributed.tensor import Replicate, Shard

    compute = private(
        "torch.distributed.tensor._utils",
        "_compute_local_shape_and_global_offset",
        "reading torch_checkpointing shards needs",
    )
    placed = [Replicate() if p == "Replicate" else Shard(int(p[6:-1])) for p in placements]
    sizes, offsets = compute(torch.Size(shape), tuple(mesh_shape), coordinate, placed)
    return tuple(int(s) for s in sizes), tuple(int(o) for o in offsets)


def mesh_world_size(mesh: Any) -> int:
    """Return how many ranks the job had whose device mesh (or a slice of it) was pickled as ``mesh``.

    A pickled mesh has no process group to ask; its rank map (``_rank_map``, every rank
    of the job's root mesh, which a slice shares) says.
    """
    rank_map = getattr(mesh, "_rank_map", None)
    if not isinstance(rank_map, torch.Tensor):
        raise unsupported("DeviceMesh._rank_map", READ_FSDP2_RANKS)
    return int(rank_map.numel())


def mesh_rank(mesh: Any) -> int | None:
    """Return the global rank a pickled mesh was saved on, or None where it does not say (``_rank``)."""
    rank = getattr(mesh, "_rank", None)
    return rank if isinstance(rank, int) and not isinstance(rank, bool) else None


def mesh_without_group(world_size: int, rank: int) -> Any:
    """Return a 1-D CPU mesh of ``world_size`` ranks as rank ``rank`` sees it, with no process group.

    ``_init_backend=False`` and ``_rank`` are DeviceMesh's own arguments for this (its
    public ``from_group`` builds meshes with the first). Building one holds and walks
    all ``world_size`` ranks (a tensor, a tuple of ints, a search for the rank), so a
    writer asking for each of M target ranks' meshes would spend O(M²) time and memory
    (at M = 100,000, 70 ms and 4.7 MB a mesh): every rank's mesh is a copy of one mesh
    built per world size, sharing those, with only its own rank and coordinate.
    """
    template = _mesh_of(world_size)
    if not vars(template).keys() <= _MESH_FIELDS | _SHARED_FIELDS_OF_LATER_TORCH:
        return _new_mesh(world_size, rank)  # a torch whose mesh holds more: build it whole
    # A shallow copy, fields in the constructor's order (a pickled mesh keeps that order).
    mesh = type(template).__new__(type(template))
    mesh.__dict__.update(vars(template))
    mesh._rank = rank
    mesh._coordinate_on_dim = (rank,)  # where rank r sits in the mesh [0, 1, ..., M - 1]
    mesh._flatten_mapping, mesh._pg_registry = {}, {}
    return mesh


# What a DeviceMesh built by ``_new_mesh`` holds (read on torch 2.13): only ``_rank`` and
# ``_coordinate_on_dim`` depend on the rank, and ``_flatten_mapping`` is filled in use. A
# torch whose mesh holds other fields gets each rank's mesh built whole, as before.
_MESH_FIELDS = frozenset(
    {
        "_device_type",
        "_layout",
        "_rank_map",
        "_mesh_dim_names",
        "_root_mesh",
        "_flatten_rank_map",
        "_thread_id",
        "_flatten_mapping",
        "_pg_registry",
        "_rank",
        "_coordinate_on_dim",
        "_hash",
    }
)
# Read on torch 2.15: a flag copied from the constructor's argument, the same for every rank.
_SHARED_FIELDS_OF_LATER_TORCH = frozenset({"_preserve_rank_order"})


def set_mesh_rank(mesh: Any, rank: int) -> bool:
    """Make a mesh from ``mesh_without_group`` say it is rank ``rank``'s; return False where it cannot.

    A writer that pickles one state dict for several target ranks changes only the
    mesh they share. False on a torch whose mesh holds fields this does not know.
    """
    fields = vars(mesh).keys()
    # The group names (job_mesh) and torch 2.15's rank-order flag hold no rank.
    if not _MESH_FIELDS <= fields or fields - _MESH_FIELDS - _RANKLESS_MESH_FIELDS:
        return False
    mesh._rank = rank
    mesh._coordinate_on_dim = (rank,)
    return True


_RANKLESS_MESH_FIELDS = frozenset({"_dim_group_names", "_preserve_rank_order"})


@functools.lru_cache(maxsize=2)
def _mesh_of(world_size: int) -> Any:
    """Return the mesh of ``world_size`` ranks as rank 0 sees it, built once per world size."""
    return _new_mesh(world_size, 0)


def _new_mesh(world_size: int, rank: int) -> Any:
    """Return a mesh of ``world_size`` ranks as ``rank`` sees it, built by DeviceMesh itself."""
    from torch.distributed.device_mesh import DeviceMesh

    accepted = inspect.signature(DeviceMesh.__init__).parameters
    if not {"_init_backend", "_rank"} <= accepted.keys():
        raise unsupported("DeviceMesh(_init_backend=..., _rank=...)", WRITE_DTENSORS)
    return DeviceMesh("cpu", list(range(world_size)), _init_backend=False, _rank=rank)


def name_groups(mesh: Any, names: Sequence[str]) -> None:
    """Name the process group of each of ``mesh``'s dimensions, as ``DeviceMesh.from_group`` does.

    A pickled mesh keeps only these names, and a job that unpickles it looks them up
    among its own groups. Where ``from_group`` no longer sets ``_dim_group_names``, a
    mesh named so would load without its groups: stop instead.
    """
    from torch.distributed.device_mesh import DeviceMesh

    code = getattr(DeviceMesh.from_group, "__code__", None)
    if code is None or "_dim_group_names" not in code.co_names:
        raise unsupported("DeviceMesh._dim_group_names", WRITE_DTENSORS)
    mesh._dim_group_names = list(names)


# --- DCP ----------------------------------------------------------------------------------

# The private names a DCP ``.metadata`` pickle holds: where each item lies, a tensor's
# memory format, its layout.
_DCP_METADATA = (
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.serialization", "_get_layout"),
)


def dcp_metadata_globals() -> dict[tuple[str, str], Any]:
    """Return what each private name a ``.metadata`` pickle holds stands for, by ``(module, name)``.

    A name this torch lacks stands for a class whose making raises ``unsupported``, so
    such a ``.metadata`` fails in one line naming the release, not as a refused pickle.
    """
    return {
        (module, name): lookup(module, name) or _stand_in(module, name, DCP_METADATA)
        for module, name in _DCP_METADATA
    }


def _stand_in(module: str, name: str, need: str) -> type:
    """Return a class named ``module.name`` whose making (a pickle's call) raises ``unsupported``."""

    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise unsupported(f"{module}.{name}", need)

    return type(name, (), {"__new__": refuse, "__module__": module})


def dcp_storage_info() -> type:
    """Return DCP's ``_StorageInfo`` (file, offset and length of a stored item), which ``.metadata`` holds."""
    return private(
        "torch.distributed.checkpoint.filesystem", "_StorageInfo", "writing DCP's .metadata needs"
    )


def dcp_version() -> str:
    """Return the version ``FileSystemWriter.finish`` records in ``.metadata`` (``CURRENT_DCP_VERSION``)."""
    return private(
        "torch.distributed.checkpoint.filesystem",
        "CURRENT_DCP_VERSION",
        "writing DCP's .metadata needs",
    )


def dcp_v2_3_paths(state_dict: dict) -> list[tuple]:
    """Return the leaf paths DCP's pre-2.4 traversal gives ``state_dict`` (it stops at some ``{}``).

    DCP's loader uses that traversal on a checkpoint it takes for a pre-2.4 one.
    """
    traverse = private(
        "torch.distributed.checkpoint._traverse",
        "traverse_state_dict_v_2_3",
        "writing an empty mapping to DCP needs",
    )
    paths: list[tuple] = []
    traverse(state_dict, lambda path, _value: paths.append(tuple(path)))
    return paths


# --- FSDP1 ------------------------------------------------------------------------------


def fake_process_group(rank: int, world_size: int) -> Any:
    """Return a process group that only knows its rank and size (FSDP1 builds layouts against it)."""
    create = private(
        "torch._C._distributed_c10d", "FakeProcessGroup._create_internal", FSDP1_LAYOUTS
    )
    return create(rank, world_size)


@dataclass(frozen=True)
class FlatParamInfo:
    """What FSDP1's ``FlatParameter`` records of its parameters and this rank's shard."""

    fqns: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    numels_with_padding: tuple[int, ...]
    is_padding: tuple[bool, ...]
    shard_numel_padded: int
    shard_param_infos: tuple[Any, ...]
    """FSDP's ``_ShardParamInfo`` per parameter: ``in_shard``, ``offset_in_shard``, ``numel_in_shard``."""
    shared_param_infos: tuple[Any, ...]
    """FSDP's ``SharedParamInfo`` per tied alias: module and parameter names of alias and primary."""


def flat_param_of(module: Any) -> Any | None:
    """Return the ``FlatParameter`` an FSDP1 unit manages, or None for a unit that holds none."""
    if not hasattr(module, "_handle"):
        raise unsupported("FullyShardedDataParallel._handle", FSDP1_LAYOUTS)
    handle = module._handle
    return None if handle is None else handle.flat_param


def flat_param_info(flat_param: Any) -> FlatParamInfo:
    """Return what ``flat_param`` records of its parameters and this rank's shard."""
    try:
        return FlatParamInfo(
            fqns=tuple(flat_param._fqns),
            shapes=tuple(tuple(s) for s in flat_param._shapes),
            numels_with_padding=tuple(int(n) for n in flat_param._numels_with_padding),
            is_padding=tuple(bool(p) for p in flat_param._is_padding_mask),
            shard_numel_padded=int(flat_param._shard_numel_padded),
            shard_param_infos=tuple(flat_param._shard_param_infos),
            shared_param_infos=tuple(flat_param._shared_param_infos),
        )
    except AttributeError as exc:
        raise unsupported(f"FlatParameter.{exc.name}", FSDP1_LAYOUTS) from None


# --- ShardedTensor (FSDP1's SHARDED_STATE_DICT) --------------------------------------------

_SHARD = "torch.distributed._shard"


@dataclass(frozen=True)
class ShardedTensorApi:
    """torch's ``ShardedTensor`` and what its pickle names: classes, and how torch.save rebuilds it."""

    ShardedTensor: type
    ShardMetadata: type
    Shard: type
    ShardedTensorMetadata: type
    TensorProperties: type
    MEM_FORMAT_ENCODING: type
    ChunkShardingSpec: type
    remote_device: type
    rebuild_wrapper_subclass: Any
    rebuild_from_type_v2: Any


def sharded_tensor() -> ShardedTensorApi:
    """Return torch's ``ShardedTensor`` classes; raise ``unsupported`` where this torch lacks one."""
    return ShardedTensorApi(
        ShardedTensor=private(f"{_SHARD}.sharded_tensor", "ShardedTensor", SHARDED_TENSORS),
        ShardMetadata=private(f"{_SHARD}.metadata", "ShardMetadata", SHARDED_TENSORS),
        Shard=private(f"{_SHARD}.sharded_tensor.shard", "Shard", SHARDED_TENSORS),
        ShardedTensorMetadata=private(
            f"{_SHARD}.sharded_tensor.metadata", "ShardedTensorMetadata", SHARDED_TENSORS
        ),
        TensorProperties=private(
            f"{_SHARD}.sharded_tensor.metadata", "TensorProperties", SHARDED_TENSORS
        ),
        MEM_FORMAT_ENCODING=private(
            f"{_SHARD}.sharded_tensor.metadata", "MEM_FORMAT_ENCODING", SHARDED_TENSORS
        ),
        ChunkShardingSpec=private(
            f"{_SHARD}.sharding_spec.chunk_sharding_spec", "ChunkShardingSpec", SHARDED_TENSORS
        ),
        remote_device=private("torch.distributed.remote_device", "_remote_device", SHARDED_TENSORS),
        rebuild_wrapper_subclass=private(
            "torch._utils", "_rebuild_wrapper_subclass", SHARDED_TENSORS
        ),
        rebuild_from_type_v2=private("torch._tensor", "_rebuild_from_type_v2", SHARDED_TENSORS),
    )
