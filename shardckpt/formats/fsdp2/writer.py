"""Writing ``fsdp2-ranks`` for M target ranks: file r holds what rank r of FSDP2 at M saves.

The process acting for target rank r (``shardckpt.formats.ranks.target_ranks``) lays out rank r's
state dict (each split tensor a ``Shard(0)`` DTensor of r's rows on a mesh of M, whole
tensors as they are, plain values) as a ``torch.save`` skeleton at ``rank_{r}.pt``
(``rank_names``), each tensor with a storage of only its own bytes; the engine then
fills each storage from the source. The mesh pickles as an FSDP2 job's 1-D CPU mesh
does (``shardckpt.formats.ranks.target_ranks.job_mesh``), so a job at M that ``torch.load``s the
file gets DTensors on a mesh that uses its own world process group.
"""

from __future__ import annotations

from functools import cached_property

from shardckpt.codecs.zip_skeleton import fake_mode
from shardckpt.core.torch_internals import set_mesh_rank
from shardckpt.formats.base import Frame
from shardckpt.formats.ranks.rank_file import (
    Fills,
    dtensor_placeholders,
    frame_rank_file,
    placeholder_rows,
    placeholder_whole,
)
from shardckpt.formats.ranks.rank_names import rank_file_name
from shardckpt.formats.ranks.rank_template import RankTemplate, own_file, rank_template, rank_width
from shardckpt.formats.ranks.target_ranks import TargetRanksWriter, job_mesh, shard_dtensor
from shardckpt.state.regions import Split, dim0_rows
from shardckpt.state.tree import TensorMeta, map_leaves

# A template holds its whole file in memory and is compared byte by byte with a second
# rendering: worth it for many small files (M = 1,024 of a few KB each), not for a few
# large ones, which are laid out as sparse skeletons in DST, one per rank, as before.
TEMPLATE_BYTES = 8 << 20


class Fsdp2RanksWriter(TargetRanksWriter):
    """``rank_{r}.pt`` of DTensors, for each target rank r a process acts for.

    Ranks that hold as many rows of every tensor share one rendering of their state
    dict (``rank_template``), each written as a file job with its own rank written in.
    """

    def frame(self, runtime) -> Frame:
        if self._largest_file() > TEMPLATE_BYTES:
            return super().frame(runtime)  # each rank's sparse skeleton, laid out in DST
        targets = self.targets(runtime)
        return runtime.agreed(lambda: Frame(files=self._jobs(targets)))

    @cached_property
    def _splits(self) -> dict[int, Split]:
        """Return the ``Shard(0)`` split of each row count a split tensor has, at the plan's M."""
        plan = self.plan
        rows = {m.shape[0] for _, m in plan.tensors if self._split(m) and m.shape}
        return {n: Split(n, plan.world_size) for n in sorted(rows)}

    def _largest_file(self) -> int:
        """Return the tensor bytes of the largest target rank's file (rank 0 holds the most rows)."""
        total = 0
        for _, meta in self.plan.tensors:
            size = meta.numel * meta.dtype.itemsize
            if self._split(meta) and meta.shape and meta.shape[0]:
                size = size // meta.shape[0] * self._splits[meta.shape[0]].spans[0][1]
            total += size
        return total

    def _jobs(self, targets: list[int]):
        plan = self.plan
        self._mesh = None
        self._made: dict[tuple, tuple] = {}
        tables = list(self._splits.values())
        kinds: dict[tuple, RankTemplate | None] = {}
        jobs = []
        for rank in targets:
            kind = (tuple(t.spans[rank][1] for t in tables), rank_width(rank))
            if kind not in kinds:
                kinds[kind] = rank_template(
                    self._render, rank, kind[1], plan.world_size, plan.metas, self._split
                )
            template = kinds[kind]
            if template is None:
                template = own_file(self._render, rank, plan.metas, self._split)
            jobs.append(template.job(rank_file_name(rank), rank, plan.world_size))
        return jobs

    def _split(self, meta: TensorMeta) -> bool:
        return meta.key not in self.plan.whole

    def _render(self, rows_rank: int, mesh_rank: int, fills: Fills) -> dict:
        """Return ``rows_rank``'s state dict of placeholders on a mesh of ``mesh_rank``.

        One mesh serves every rendering (only its rank changes), so a DTensor placeholder
        made for some rows serves every kind of rank that holds as many of that tensor.
        """
        plan = self.plan
        if self._mesh is None:
            self._mesh = job_mesh(plan.world_size, mesh_rank)
        if not set_mesh_rank(self._mesh, mesh_rank):
            return dtensor_placeholders(
                plan, rows_rank, job_mesh(plan.world_size, mesh_rank), fills
            )
        made = self._made

        def place(_path, leaf):
            if not isinstance(leaf, TensorMeta):
                return leaf
            if leaf.key in plan.whole:
                kind = (leaf.key, None)
                if kind not in made:
                    noted: Fills = {}
                    made[kind] = (placeholder_whole(noted, leaf), noted)
            else:
                first, stop = dim0_rows(leaf.shape, plan.world_size, rows_rank)  # type: ignore[misc]
                kind = (leaf.key, stop - first)
                if kind not in made:
                    found: Fills = {}
                    local = placeholder_rows(found, leaf, plan.world_size, rows_rank)
                    made[kind] = (shard_dtensor(local, leaf, self._mesh), found)
            placeholder, its_fills = made[kind]
            fills.update(its_fills)
            return placeholder

        with fake_mode():
            return map_leaves(plan.tree, place)

    def frame_rank(self, rank: int) -> Frame:
        fills: Fills = {}
        mesh = job_mesh(self.plan.world_size, rank)
        state_dict = dtensor_placeholders(self.plan, rank, mesh, fills)
        return frame_rank_file(self.root / rank_file_name(rank), state_dict, fills)
