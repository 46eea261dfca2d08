"""The launch runtime: the only module that creates or destroys process groups.

Standalone runs (no ``torchrun`` environment) get a world of one and no process group.
Under ``torchrun`` the process group comes from the environment, ``gloo`` on every rank;
when every rank has a GPU of its own (``--device`` overrides), CUDA tensors go over an
``nccl`` group made beside it, once the ranks agreed on that over gloo.

Protocol, per command:
  1) (all ranks) ``launch(device)`` enters; every rank validates its inputs identically.
  2) (all ranks) each phase that can fail on one rank only is wrapped in ``agreed(...)``,
     so every rank learns of the first failure instead of waiting in a collective; a
     check of what each rank sees for itself (DST on its node's disk) runs in
     ``check(...)``, which raises the same error on every rank.
  3) (all ranks) ``launch`` exits: barrier on success, then ``destroy_process_group``.

Every collective runs through a ``Runtime`` method. One that fails (a peer died, or
did not answer within ``SHARDCKPT_TIMEOUT`` seconds) raises ``CollectiveFailure`` at
once: the group is broken, so no further collective (agreement, barrier) is tried.

A rank that stops for a reason the others do not know (its own error, a signal) writes
it into the launch's key-value store on its way out, before its sockets close, unless
another rank did first (``_tell_others``): under torchrun the store is the agent's, and
outlives every rank. The first rank to write prints its own line; a rank that then
loses contact with it reads why (``_lost_contact``) and stays silent (``PeerFailure``),
as does a rank the agent stops with SIGTERM because that one failed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

from shardckpt.core.errors import (
    CollectiveFailure,
    IOFailure,
    PeerFailure,
    RemoteRankError,
    ShardckptError,
    UsageError,
    in_chain,
    notice,
)
from shardckpt.core.lazy_torch import LazyModule, torch
from shardckpt.core.rank_env import env_rank
from shardckpt.core.signals import Interrupted, ending, sheltered

# Imported when a command first runs a collective or makes a device: a standalone run on
# the CPU needs neither, and ``inspect``/``verify`` of metadata import no torch.
dist = LazyModule("torch.distributed")

T = TypeVar("T")

# A rank that dies or wedges must not keep the others waiting for torch's default of
# 30 minutes; torchrun also kills the survivors once one worker exits non-zero.
DEFAULT_TIMEOUT_S = 300


@dataclass(frozen=True)
class Runtime:
    """Where this process sits in the launch: rank, world size, device, 1-D device mesh."""

    rank: int = 0
    world_size: int = 1
    device: torch.device | str = "cpu"
    """A ``torch.device``; ``"cpu"`` standalone on the CPU, where torch may not be imported."""
    mesh: object | None = None  # DeviceMesh over all ranks; None when standalone
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def distributed(self) -> bool:
        """Return whether a process group is up (launched by torchrun)."""
        return self.mesh is not None

    @property
    def device_type(self) -> str:
        """Return ``cpu`` or ``cuda``."""
        return self.device if isinstance(self.device, str) else self.device.type

    @property
    def coordinator(self) -> bool:
        """Return whether this rank prints, renames outputs and writes full files."""
        return self.rank == 0

    @contextlib.contextmanager
    def collective(self) -> Iterator[None]:
        """Turn the failure of the collective inside into ``CollectiveFailure``, naming the cause."""
        try:
            yield
        except CollectiveFailure:
            raise
        except Exception as exc:  # gloo and NCCL raise RuntimeError subclasses for both causes
            # The group is broken: this rank fails whatever comes next, and the agent's
            # SIGTERM (sent once the rank that left exits) may come while it removes its
            # partial output, before it said why: the signal must not replace that line.
            ending()
            raise _lost_contact(exc, self.rank, self.timeout_s) from None

    def barrier(self) -> None:
        """Wait for every rank (no-op standalone)."""
        if self.distributed:
            with self.collective():
                dist.barrier()

    def agreed(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on every rank and fail on every rank if it failed on any."""
        error: BaseException | None = None
        result = None
        try:
            result = fn()
        except CollectiveFailure:
            raise  # the group is broken: there is no agreeing over it
        except Exception as exc:  # noqa: BLE001 - every failure must reach the other ranks
            if known_everywhere(exc):
                # An agreement inside ``fn`` already told every rank; the ranks that saw it
                # there are past it, and would never answer another collective.
                raise
            error = exc
        self.raise_if_any_failed(error)
        return result  # type: ignore[return-value]

    def check(self, fn: Callable[[], None]) -> None:
        """Run the check ``fn`` on every rank; raise one error, the same on every rank, if it failed on any.

        For what each rank judges from its own view (DST on its node's disk): the outcomes
        are shared in one collective, and where not every rank failed alike, the line
        says which ranks (and hosts) did. ``fn`` must run no collective.
        """
        if not self.distributed:
            fn()
            return
        error = _first_failure(self.all_gather((socket.gethostname(), _failure_of(fn))))
        if error is not None:
            error.everywhere = True  # every rank raises it; rank 0 reports it
            ending()
            raise error

    def raise_if_any_failed(self, error: BaseException | None) -> None:
        """Share ``error`` with all ranks; re-raise the lowest failing rank's error everywhere."""
        if not self.distributed:
            if error is not None:
                raise error  # alone: no launcher stops this process for another's failure
            return
        mine = None if error is None else (self.rank, _one_line(error), _exit_code(error))
        if error is not None:
            # This rank fails whatever the others say: a SIGTERM from the agent during the
            # gather (another rank returned from it first and exited) must not cut its line.
            ending()
        everyone: list[tuple[int, str, int] | None] = [None] * self.world_size
        with self.collective():
            dist.all_gather_object(everyone, mine)
        failures = [f for f in everyone if f is not None]
        if not failures:
            return
        ending()  # every rank fails now; the agent's SIGTERM must not cut off the line
        first_rank, line, code = min(failures)
        if first_rank == self.rank and error is not None:
            error.agreed = True  # every rank knows; this rank is the one that reports it
            raise error
        raise RemoteRankError(first_rank, line, code)

    def gather(self, obj: T) -> list[T] | None:
        """Return every rank's picklable ``obj`` in rank order on the coordinator, None elsewhere."""
        if not self.distributed:
            return [obj]
        out: list | None = [None] * self.world_size if self.coordinator else None
        with self.collective():
            dist.gather_object(obj, out, dst=0)
        return out

    def broadcast(self, obj: T, src: int = 0) -> T:
        """Return rank ``src``'s picklable ``obj`` on every rank (the coordinator's by default)."""
        if not self.distributed:
            return obj
        box = [obj]
        with self.collective():
            dist.broadcast_object_list(box, src=src)
        return box[0]

    def all_gather(self, obj: T) -> list[T]:
        """Return every rank's picklable ``obj``, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        out: list = [None] * self.world_size
        with self.collective():
            dist.all_gather_object(out, obj)
        return out

    def all_to_all(
        self, send: torch.Tensor, send_sizes: list[int], recv_sizes: list[int]
    ) -> torch.Tensor:
        """Send ``send_sizes[r]`` bytes of ``send`` (in rank order) to each rank r; return what came.

        The bytes travel on this runtime's device: over NCCL between GPUs, gloo on CPU.
        """
        if not self.distributed:
            return send.clone()
        # CUDA tensors go over the mesh's NCCL group; the default group is gloo's.
        group = self.mesh.get_group() if self.device_type == "cuda" else None  # type: ignore[attr-defined]
        send = send.to(self.device)
        recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=self.device)
        with self.collective():
            dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group)
        return recv.cpu()

    def gather_into(self, tensor: torch.Tensor, blocks: list[torch.Tensor] | None) -> None:
        """Gather every rank's same-shape ``tensor`` into the coordinator's ``blocks`` (rank order)."""
        with self.collective():
            dist.gather(tensor, blocks if self.coordinator else None, dst=0)

    def max_over_ranks(self, tensor: torch.Tensor) -> None:
        """Replace ``tensor`` in place by its elementwise maximum over every rank."""
        if self.distributed:
            with self.collective():
                dist.all_reduce(tensor, op=dist.ReduceOp.MAX)


def under_torchrun() -> bool:
    """Return whether the environment was set up by torchrun (or another launcher)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


@contextlib.contextmanager
def launch(device: str | None = None) -> Iterator[Runtime]:
    """Yield the runtime for this process, tearing the process group down on every exit path."""
    if device not in (None, "cpu", "cuda"):
        raise UsageError(f"unknown --device {device!r}", hint="use --device cpu or --device cuda")
    if not under_torchrun():
        if device == "cuda" and not torch.cuda.is_available():
            raise UsageError(
                "--device cuda was given but this machine has no CUDA GPU", hint="use --device cpu"
            )
        yield Runtime(device=torch.device("cuda")) if device == "cuda" else Runtime()
        return
    # Under torchrun no rank decides alone, not even to fail: a rank that left before the
    # process group exists would leave the others waiting in it (see device_for).

    rank, world_size = env_rank(), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    has_gpu = (
        device != "cpu" and torch.cuda.is_available() and torch.cuda.device_count() > local_rank
    )
    timeout = timedelta(seconds=float(os.environ.get("SHARDCKPT_TIMEOUT", DEFAULT_TIMEOUT_S)))
    try:
        # Every rank asks for the same backend, whatever GPUs it sees: a rank asking for
        # gloo+nccl and another for gloo alone wait for each other forever. Which ranks
        # have a GPU is agreed over this group, before any CUDA work.
        dist.init_process_group(backend="gloo", timeout=timeout)
    except Exception as exc:
        raise IOFailure(
            f"could not join the process group ({_backend_cause(exc)})",
            hint="check the torchrun rendezvous settings (MASTER_ADDR, MASTER_PORT)",
        ) from exc
    in_step = False  # whether every rank is known to reach the teardown together
    failing = False
    runtime = Runtime(rank=rank, world_size=world_size, timeout_s=timeout.total_seconds())
    try:
        with_gpu = _count_ranks(runtime, has_gpu)
        try:
            dev_type = device_for(device, with_gpu, world_size)
        except UsageError as exc:
            exc.everywhere = True  # from agreed counts: every rank raises it; rank 0 reports it
            raise
        if device is None and 0 < with_gpu < world_size and runtime.coordinator:
            notice(
                f"running on CPU: {with_gpu} of the {world_size} ranks have a GPU of their own "
                "(pass --device cpu to say so and silence this note)"
            )
        with runtime.collective():
            dev, mesh = _join_device(dev_type, local_rank, world_size)
        yield dataclasses.replace(runtime, device=dev, mesh=mesh)
        in_step = True
    except BaseException as exc:
        # A failure every rank agreed on brings them all here; one only this rank saw
        # may have left the others in a collective, and a barrier would wait for them.
        in_step = known_everywhere(exc)
        failing = True
        ending()
        if not in_step and not isinstance(exc, CollectiveFailure):
            _tell_others(exc, rank)
        raise
    finally:
        # A failing rank's error is still the one it reports when torchrun's SIGTERM (sent
        # as soon as any rank exits) comes while it waits here for the others.
        with sheltered(raising=not failing):
            # gloo can abort (SIGABRT) a rank whose peers tear down first, so ranks that
            # are in step leave together.
            if in_step:
                with contextlib.suppress(Exception):
                    dist.barrier()
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def device_for(requested: str | None, with_gpu: int, world_size: int) -> str:
    """Return the device type every rank runs on, from ``--device`` and how many ranks have a GPU.

    The same on every rank (its inputs are agreed). ``--device cuda`` needs a GPU on
    every rank; with no ``--device``, CUDA is used only when every rank has one.
    """
    if requested == "cpu":
        return "cpu"
    if with_gpu == world_size:
        return "cuda"
    if requested == "cuda":
        raise UsageError(
            f"--device cuda was given but only {with_gpu} of the {world_size} ranks have a GPU "
            "of their own",
            hint="use --device cpu, or launch one process per GPU",
        )
    return "cpu"


def _count_ranks(runtime: Runtime, flag: bool) -> int:
    """Return on how many ranks ``flag`` is true (over the gloo group)."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    with runtime.collective():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return int(t.item())


def _join_device(dev_type: str, local_rank: int, world_size: int) -> tuple[torch.device, object]:
    """Return this rank's device and the 1-D mesh over every rank on that device type.

    On CUDA, collectives of CUDA tensors go over an NCCL group made beside the gloo one.
    """
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if dev_type == "cuda":
        torch.cuda.set_device(local_rank)
        group = dist.new_group(backend="nccl")
        return torch.device("cuda", local_rank), DeviceMesh.from_group(group, "cuda")
    return torch.device("cpu"), init_device_mesh("cpu", (world_size,))


def _lost_contact(exc: BaseException, rank: int, timeout_s: float) -> BaseException:
    """Return the one-line error for a failed collective: a timeout, or a peer that went away.

    A peer that said why it stopped (``_tell_others``) is taken at its word: its error,
    printed there (``PeerFailure``), or the signal that stopped it (``Interrupted``).
    """
    told = _first_told()
    if told is not None and told["rank"] != rank:
        if "signal" in told:
            return Interrupted(told["signal"], rank=told["rank"])
        return PeerFailure(told["rank"], told["line"], told["code"])
    if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
        return CollectiveFailure(
            f"rank {rank} waited {timeout_s:g} s for the other ranks and gave up",
            hint="a rank stalled or died (its error, if any, is above); "
            "raise SHARDCKPT_TIMEOUT if a rank is only slow",
        )
    return CollectiveFailure(
        f"rank {rank} lost contact with another rank ({_backend_cause(exc)})",
        hint="another rank died; its error, if it printed one, is above",
    )


_FIRST_STOP = "shardckpt/first-stop"
"""The store's key for why the first rank that stopped on its own did (``_tell_others``)."""


def _tell_others(exc: BaseException, rank: int) -> None:
    """Write why this rank stops into the launch's store, unless another rank did first.

    Marks ``exc`` with what this rank prints: its error only if it was the first to stop
    (``first_to_fail``; the same error seen by every rank is printed once); nothing for a
    signal the agent sent because another rank failed (``quiet``). Without a store
    nothing is marked, and rank 0 reports as it would standalone.
    """
    signalled = in_chain(exc, Interrupted)
    if signalled is not None and signalled.complete:
        return  # DST is in place: no failure to tell
    said = (
        {"rank": rank, "signal": signalled.signum}
        if signalled is not None
        else {"rank": rank, "line": _one_line(exc), "code": _exit_code(exc)}
    )
    from shardckpt.core.torch_internals import default_store

    store = default_store()
    if store is None:
        return
    record = json.dumps(said)
    try:
        first = store.compare_set(_FIRST_STOP, "", record).decode() == record
    except Exception:  # noqa: BLE001 - the store is a courtesy; rank 0 reports without it
        return
    if signalled is None:
        exc.first_to_fail = first  # type: ignore[attr-defined]
        return
    told = None if first else _first_told()
    signalled.quiet = told is not None and "signal" not in told  # type: ignore[attr-defined]


def _first_told() -> dict | None:
    """Return what the first rank to stop wrote into the launch's store (``_tell_others``), if one did."""
    from shardckpt.core.torch_internals import default_store

    store = default_store()
    if store is None:
        return None
    try:
        if not store.check([_FIRST_STOP]):
            return None
        return json.loads(store.get(_FIRST_STOP))
    except Exception:  # noqa: BLE001 - a store gone with its host tells nothing
        return None


# gloo's messages start with the source line that raised them ("[.../pair.cc:537] ").
_SOURCE_LINE = re.compile(r"^\[[^\]]*:\d+\]\s*")


def _backend_cause(exc: BaseException) -> str:
    """Return what gloo or NCCL says failed, as a short ASCII phrase for our one line.

    Their text is several sentences, lines and a source location, with advice and an
    emoji after the cause ("... Connection reset by peer. This is typically caused by
    ... GLHF! ..."): only the first sentence of the first line is kept.
    """
    lines = str(exc).strip().splitlines()
    first = _SOURCE_LINE.sub("", lines[0] if lines else "").split(". ")[0]
    cause = first.encode("ascii", "ignore").decode().strip().rstrip(".")
    return cause or type(exc).__name__


_Failure = tuple[type, str, "str | None", str]
"""A failed check as it travels between ranks: error type, message, path, hint."""


def _failure_of(fn: Callable[[], None]) -> _Failure | None:
    """Return how ``fn`` failed on this rank, or None when it passed."""
    try:
        fn()
    except CollectiveFailure:
        raise
    except ShardckptError as exc:
        return type(exc), exc.message, exc.path, exc.hint
    except Exception as exc:  # noqa: BLE001 - every failure must reach the other ranks
        return IOFailure, _one_line(exc), None, ""
    return None


def _first_failure(everyone: list[tuple[str, _Failure | None]]) -> ShardckptError | None:
    """Return the lowest failing rank's error, saying where it was seen when not everywhere.

    ``everyone`` is each rank's host and failure, in rank order.
    """
    failed = [(rank, seen) for rank, (_, seen) in enumerate(everyone) if seen is not None]
    if not failed:
        return None
    cls, message, path, hint = failed[0][1]
    alike = [rank for rank, seen in failed if seen == failed[0][1]]
    if len(alike) < len(everyone):
        hosts = sorted({everyone[r][0] for r in alike})
        clean = [r for r, (_, seen) in enumerate(everyone) if seen is None]
        message += (
            f" (on {_ranks(alike)}, {'host' if len(hosts) == 1 else 'hosts'} "
            f"{', '.join(hosts)}{f'; not on {_ranks(clean)}' if clean else ''})"
        )
    return cls(message, path=path, hint=hint)


def known_everywhere(error: BaseException) -> bool:
    """Return whether every rank knows of ``error``: it came out of an agreement (``agreed``, ``check``)."""
    return (
        isinstance(error, RemoteRankError)
        or getattr(error, "agreed", False)
        or getattr(error, "everywhere", False)
    )


def _ranks(ranks: list[int]) -> str:
    """Return ``rank 3``, ``ranks 0-3`` or ``ranks 0, 2, 5`` for sorted ``ranks``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return f"ranks {', '.join(map(str, ranks))}"


def _one_line(error: BaseException) -> str:
    if isinstance(error, ShardckptError):
        return error.line()
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


def _exit_code(error: BaseException) -> int:
    return getattr(error, "exit_code", IOFailure.exit_code)
