"""Writing behind: rank 0 hands whole tensors to one writer thread and goes on gathering.

Without it, every rank waits while rank 0 writes each tensor. File writes release the
GIL, so the thread overlaps disk work with the next collective. Pending tensors are
capped in bytes, so memory stays bounded by the batch buffer.
"""

from __future__ import annotations

import queue
import threading

import torch

from shardckpt.formats.base import FullWriter
from shardckpt.tree import TensorMeta


class WriteBehind:
    """Wraps a ``FullWriter``: ``write`` queues, ``close`` drains; a failure re-raises on the caller."""

    def __init__(self, writer: FullWriter, max_pending_bytes: int):
        self._writer = writer
        self._limit = max(1, max_pending_bytes)
        self._pending = 0
        self._room = threading.Condition()
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._drain, name="shardckpt-writer", daemon=True)
        self._thread.start()

    def write(self, meta: TensorMeta, tensor: torch.Tensor) -> None:
        """Queue one whole tensor; waits while too many bytes are already pending."""
        self._raise_if_failed()
        size = meta.nbytes
        with self._room:
            # A tensor bigger than the limit still goes, alone, once the queue is empty.
            self._room.wait_for(lambda: self._pending == 0 or self._pending + size <= self._limit)
            self._pending += size
        self._queue.put((meta, tensor, size))

    def close(self) -> None:
        """Wait for every queued tensor to be written, then close the file."""
        self._queue.put(None)
        self._thread.join()
        self._raise_if_failed()
        self._writer.close()

    def abandon(self) -> None:
        """Stop the thread after a failure; queued tensors are dropped, the file left unfinished."""
        self._error = self._error or RuntimeError("abandoned")
        self._queue.put(None)
        self._thread.join()
        self._writer.abandon()

    def _drain(self) -> None:
        while (item := self._queue.get()) is not None:
            meta, tensor, size = item
            if self._error is None:
                try:
                    self._writer.write(meta, tensor)
                except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                    self._error = exc
            del tensor
            with self._room:
                self._pending -= size
                self._room.notify_all()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error
