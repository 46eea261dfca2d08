"""``--verify``: the staged output read back and compared with SRC before it becomes DST.

Reading it back checks the CRC-32 written with each of DST's records (and a safetensors
output's digests) as their bytes are read: a mismatch is bytes the disk did not keep.
"""

from __future__ import annotations

from pathlib import Path

from shardckpt.core.destination import Destination
from shardckpt.core.dist import Runtime
from shardckpt.core.errors import IOFailure, RemoteRankError, ShardckptError, source_option
from shardckpt.core.placement import Placement
from shardckpt.core.progress import Progress
from shardckpt.core.sight import look
from shardckpt.engine.compare import compare
from shardckpt.engine.exchange import SharedReader
from shardckpt.engine.read_checks import judged, within
from shardckpt.formats import format_named, open_reader
from shardckpt.formats.dcp.reader import as_stored
from shardckpt.plan.plan import ConvertPlan
from shardckpt.plan.selection import Selection, select
from shardckpt.state.tree import tensor_leaves


def verify_output(
    reader,
    plan: ConvertPlan,
    destination: Destination,
    runtime: Runtime,
    trust_pickle: bool,
    placement: Placement,
    progress: Progress,
):
    """Read the staged output back and compare it with SRC; raise if anything differs."""
    dst = destination.dst
    # DCP hands every mapping key back as str; compare with what it can hold, on both
    # sides (a format that is partly DCP, Lightning's, keeps its other part's keys).
    as_str = format_named(plan.format).keys_as_str
    expected = as_stored(plan.tree) if as_str else plan.tree

    def written_reader():
        # On several disks, each rank sees its disk's part of the output, as of a node-local SRC.
        sight = look(destination.tmp, runtime) if placement.several else None
        written = open_reader(destination.tmp, plan.format, trust_pickle, plan.flat_model, sight)
        index = written.index()
        if sight is not None and not sight.complete:
            metas = {m.key: m for _, m in index.tensors()}
            written = SharedReader(written, sight, metas, plan.buffer_bytes)
        tree = select(index, Selection(clean_fqns=False))
        return written, as_stored(tree) if as_str else tree

    try:
        with source_option("--from"):
            written, tree = runtime.agreed(written_reader)
        progress.begin(sum(m.nbytes for _, m in tensor_leaves(expected)), "verify")
        check = compare(
            reader,
            expected,
            written,
            tree,
            runtime,
            progress=progress,
            buffer_bytes=plan.buffer_bytes,
        )
        damaged = judged(runtime, within(destination.tmp))
    except ShardckptError as exc:
        if isinstance(exc, RemoteRankError):
            raise
        raise IOFailure(
            f"--verify could not read the output back ({exc.line()}); nothing was written to DST",
            path=dst,
            hint="please report this",
        ) from None
    if damaged is not None and damaged.damaged:
        # The checksums written with DST's records, as DST was read back: the bytes on
        # disk are not those the fill wrote (the disk, or memory on the way).
        first = damaged.damaged[0]
        name = Path(first.written.file).relative_to(destination.tmp).as_posix()
        name = Path(dst).name if name == "." else name
        raise IOFailure(
            f"--verify read the output back and {first.message()} in '{name}'; "
            "nothing was written to DST",
            path=dst,
            hint="the output was damaged as it was written: check the disk, and run again",
        )
    if not check.equal:
        first = check.differences[0]
        raise IOFailure(
            f"--verify found {len(check.differences)} differing leaves, first "
            f"'{'.'.join(map(str, first.path))}' ({first.reason}); nothing was written to DST",
            path=dst,
            hint="the output did not read back equal to SRC; please report this",
        )
    return True
