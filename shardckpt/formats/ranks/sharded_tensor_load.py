"""Loading one rank's ``torch.save`` file of ``ShardedTensor``s without a process group.

Which file is which rank's is ``shardckpt.formats.ranks.rank_names``.

``ShardedTensor.__setstate__`` insists on a default process group of the saving job's
size and rank, so a file of rank 3 of 4 cannot be loaded by any other process. The
unpickler is told to build ``StoredShardedTensor`` instead: the same state (local
shards, global shard metadata, the saver's rank and world size), no process group.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

from shardckpt.core.torch_internals import sharded_tensor
from shardckpt.formats.torch_save.in_place import load_in_place

SHARDED_TENSOR = "torch.distributed._shard.sharded_tensor.api.ShardedTensor"


class _ProcessGroupState:
    """``ShardedTensor.ProcessGroupState``: the saving rank and world size."""

    local_rank: int
    global_rank: int
    local_world_size: int
    global_world_size: int


class StoredShardedTensor(torch.Tensor):
    """A ShardedTensor as stored: global shape, this file's local shards, every rank's shard metadata."""

    ProcessGroupState = _ProcessGroupState

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"{func} on a stored ShardedTensor: read its local shards instead")

    def __setstate__(self, state) -> None:
        self.local_shards, self.st_metadata, self.pg_state, self.spec, _ = state

    @property
    def shards_metadata(self) -> list:
        """Return the metadata of every rank's shard (the whole tensor's layout)."""
        return list(self.st_metadata.shards_metadata)

    @property
    def saved_world_size(self) -> int:
        """Return the world size of the job that saved this tensor."""
        return int(self.pg_state.global_world_size)


def _process_group_state(owner: object, name: object) -> type:
    """Return ``ShardedTensor.ProcessGroupState``: ``builtins.getattr`` for that one lookup only.

    Protocol 2 cannot name a nested class, so ``torch.save`` pickles it as
    ``getattr(ShardedTensor, "ProcessGroupState")``. The real ``getattr`` on the
    allow-list would let a pickle walk from any allowed name to ``eval``
    (``ShardMetadata.__init__.__builtins__``); this stand-in answers nothing else.
    """
    if owner is StoredShardedTensor and type(name) is str and name == "ProcessGroupState":
        return _ProcessGroupState
    what = repr(name) if type(name) is str else f"a {type(name).__name__}"
    raise pickle.UnpicklingError(
        f"getattr of {what}, where a ShardedTensor only looks up ProcessGroupState"
    )


def safe_globals() -> list:
    """Return the allow-list of a rank file: ShardedTensor's metadata classes, and stand-ins.

    The stand-ins go under the names the pickle uses. Each callable here is harmless
    whatever arguments a pickle passes it.
    """
    api = sharded_tensor()
    return [
        (StoredShardedTensor, SHARDED_TENSOR),
        # Named so that NEWOBJ may build it; the pickle reaches it through getattr, below.
        (_ProcessGroupState, f"{SHARDED_TENSOR}.ProcessGroupState"),
        (_process_group_state, "builtins.getattr"),
        api.ShardMetadata,
        api.Shard,
        api.ChunkShardingSpec,
        api.remote_device,
        api.ShardedTensorMetadata,
        api.TensorProperties,
        api.MEM_FORMAT_ENCODING,
    ]


class _TrustedUnpickler(pickle.Unpickler):
    """Plain pickle (``--trust-pickle``), with the stand-in for ShardedTensor."""

    def find_class(self, module: str, name: str):
        if f"{module}.{name}" == SHARDED_TENSOR:
            return StoredShardedTensor
        return super().find_class(module, name)


class _TrustedPickle:
    """A ``pickle_module`` for ``torch.load`` that uses ``_TrustedUnpickler``."""

    Unpickler = _TrustedUnpickler
    load = pickle.load


def load_rank_file(path: Path, trust_pickle: bool) -> dict:
    """Return the state dict in one rank's file, memory-mapped, ShardedTensors as ``StoredShardedTensor``."""
    allowed = safe_globals()
    return load_in_place(path, trust_pickle, safe_globals=allowed, trusted_pickle=_TrustedPickle)
