"""What a torchrun launch larger than its work is told, once, before the data moves.

More processes make a conversion faster only while each has work of its own and a core
to run on: a process for a target rank that does not exist writes nothing, and gloo
ranks beyond a node's cores wait for each other. A launch that runs slower than one
process, without a word, looks like a slow tool.
"""

from __future__ import annotations

import os


def idle_ranks(launched: int, layout: str, world_size: int) -> str | None:
    """Return the note for a launch of more processes than a sharded or local DST has target ranks."""
    if layout == "full" or launched <= world_size:
        return None
    idle = launched - world_size
    return (
        f"{launched} ranks launched for --world-size {world_size}: {idle} of them "
        f"{'has' if idle == 1 else 'have'} no target rank's files to write (launch "
        f"--nproc-per-node {world_size} or fewer; the output is the same)"
    )


def crowded_cores(local_ranks: int, cores: int) -> str | None:
    """Return the note for more CPU ranks on this node than it has cores to run them on."""
    if local_ranks <= cores:
        return None
    return (
        f"{local_ranks} CPU ranks on this node share {cores} "
        f"{'core' if cores == 1 else 'cores'}, so they wait for each other (launch "
        f"--nproc-per-node {cores} or fewer; the output is the same)"
    )


def usable_cores() -> int:
    """Return the CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def launch_notes(
    launched: int, layout: str, world_size: int, device_type: str, local_ranks: int | None = None
) -> list[str]:
    """Return the notes for a launch of ``launched`` processes writing ``layout`` at ``world_size``."""
    notes = [idle_ranks(launched, layout, world_size)]
    if device_type == "cpu":
        local = local_ranks or int(os.environ.get("LOCAL_WORLD_SIZE", launched))
        notes.append(crowded_cores(local, usable_cores()))
    return [n for n in notes if n is not None]
