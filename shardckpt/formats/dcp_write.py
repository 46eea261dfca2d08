"""Writing ``dcp`` for M target ranks from any number of processes, with DCP's own protocol.

``dcp.save`` writes one file per process of the launch. To write M files from N
processes, each process runs DCP's per-rank steps once per target rank it acts for
(``shardckpt.virtual``), and the object collectives DCP would run among M ranks run
among the N real ones instead. Call order, as in torch's ``_save_state_dict``:
  1) (each target rank) ``planner.set_up_planner`` -> ``create_local_plan`` ->
     ``storage_writer.prepare_local_plan``; the plans are gathered to real rank 0.
  2) (coordinator, target rank 0) ``planner.create_global_plan`` (dedup of tensors
     every rank holds, metadata, validation) -> ``storage_writer.prepare_global_plan``
     (file ``__r_0.distcp`` for target rank r); the plans are broadcast back.
  3) (each target rank) ``planner.finish_plan`` -> ``storage_writer.write_data``;
     the write results are gathered to real rank 0.
  4) (coordinator) ``storage_writer.finish(metadata, results)`` writes ``.metadata``.
Every step runs under ``Runtime.agreed``, so a failure anywhere stops every process.
"""

from __future__ import annotations

from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan

from shardckpt.dist import Runtime


def _in_target_order(per_rank: list[dict[int, object]], world_size: int) -> list:
    """Return the values of the per-process ``{target rank: value}`` dicts ordered by target rank."""
    merged = {r: v for part in per_rank for r, v in part.items()}
    return [merged[r] for r in range(world_size)]


def write_dcp(path: Path, state_dicts: dict[int, dict], world_size: int, runtime: Runtime) -> None:
    """Save ``state_dicts`` (target rank -> its state dict) as a DCP checkpoint of ``world_size`` ranks."""
    # thread_count=1 and one file per rank: what dcp.save does by default, so each
    # target rank gets exactly one data file, as it would in training.
    writer = FileSystemWriter(path, single_file_per_rank=True, thread_count=1)
    planners = {r: DefaultSavePlanner() for r in state_dicts}

    def local_plans() -> dict[int, SavePlan]:
        writer.set_up_storage_writer(runtime.coordinator, rank=runtime.rank, use_collectives=True)
        plans = {}
        for r, state_dict in state_dicts.items():
            planner = planners[r]
            planner.set_up_planner(
                state_dict, storage_meta=writer.storage_meta(), is_coordinator=r == 0
            )
            plans[r] = writer.prepare_local_plan(planner.create_local_plan())
        return plans

    gathered = runtime.gather(runtime.agreed(local_plans))

    def global_plan():
        if not runtime.coordinator:
            return None
        plans, metadata = planners[0].create_global_plan(_in_target_order(gathered, world_size))
        return writer.prepare_global_plan(plans), metadata

    central = runtime.agreed(global_plan)
    plans = runtime.broadcast(central[0] if central is not None else None)

    def write() -> dict[int, list]:
        results = {}
        for r, planner in planners.items():
            future = writer.write_data(planner.finish_plan(plans[r]), planner)
            future.wait()
            results[r] = future.value()
        return results

    results = runtime.gather(runtime.agreed(write))
    runtime.agreed(
        lambda: (
            writer.finish(central[1], _in_target_order(results, world_size))
            if runtime.coordinator
            else None
        )
    )
