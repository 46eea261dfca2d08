"""Progress, phase by phase: a tqdm bar on rank 0's stderr when it is a terminal, silent otherwise.

Sizes and rates are binary (KiB, MiB, GiB), as everywhere else shardckpt prints them;
tqdm's own scaling would print sizes in one system and rates in the other. Before the
first bar (reading metadata, planning), a phase that keeps the terminal silent for more
than a second says what it is doing, one line each.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from typing import TYPE_CHECKING

from shardckpt.core.streams import say

if TYPE_CHECKING:
    from tqdm import tqdm


def human_bytes(n: float) -> str:
    """Return ``n`` bytes as a short human string (``1.5 MiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


STATUS_AFTER_S = 1.0
"""How long a terminal stays silent before a phase without a bar says what it is doing."""


class Progress:
    """Counts the work of one phase at a time; draws a bar only when ``enabled`` and stderr is a terminal."""

    def __init__(self, enabled: bool = False, desc: str = "", status_after: float | None = None):
        # CI logs are not terminals, but some CI runners fake one; CI=true keeps them clean too.
        self.enabled = (
            enabled
            and sys.stderr is not None
            and sys.stderr.isatty()
            and os.environ.get("CI", "").lower() not in ("1", "true")
        )
        self.desc = desc
        self._bar: tqdm | None = None
        self._bytes = True
        self._status_after = STATUS_AFTER_S if status_after is None else status_after
        self._lock = threading.Lock()
        self._status: str | None = None
        self._timer: threading.Timer | None = None
        self._talking = False
        """Whether a status line was printed since the last bar: the next one is said at once."""

    def status(self, text: str) -> None:
        """Say ``text`` on stderr once the terminal has been silent ``status_after`` seconds.

        For work that has no bar (reading metadata, planning): quick work says nothing;
        after a silent second each phase says what it is, and ``begin`` or ``close`` ends it.
        """
        if not self.enabled:
            return
        with self._lock:
            if text == self._status:
                return  # the same phase, named again by the next step of it
            self._status = text
            if self._talking:
                self._say(text)
            elif self._timer is None:
                self._timer = threading.Timer(self._status_after, self._silence_ended)
                self._timer.daemon = True
                self._timer.start()

    def _silence_ended(self) -> None:
        with self._lock:
            if self._status is not None and self._timer is not None:
                self._talking = True
                self._say(self._status)

    def _say(self, text: str) -> None:
        say(f"shardckpt: {text}...")

    def _end_status(self) -> None:
        """Stop a pending status line: a bar (or the end of the run) is what shows now."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = None
            self._status = None
            self._talking = False

    def begin(self, total: int, phase: str = "", unit: str = "bytes") -> None:
        """Start a phase (ending the one before) that counts towards ``total`` bytes, or files."""
        self.close()
        if not self.enabled:
            return
        self._bytes = unit == "bytes"
        desc = f"{self.desc} {phase}".strip() if phase else self.desc
        self._bar = _bar_class(self._bytes)(
            total=total,
            desc=desc,
            unit="" if self._bytes else f" {unit}",
            file=sys.stderr,
            leave=False,
            dynamic_ncols=True,
            bar_format=(
                "{desc}: {percentage:3.0f}%|{bar}| {sizes} [{elapsed}<{remaining}]"
                if self._bytes
                else "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt}{unit} [{elapsed}]"
            ),
        )

    def __call__(self, n: int) -> None:
        """Advance by ``n`` bytes (or files)."""
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        """Remove the bar, and any status line still waiting to be said."""
        self._end_status()
        if self._bar is not None:
            self._bar.close()
            self._bar = None


@functools.cache
def _bar_class(of_bytes: bool) -> type[tqdm]:
    """Return tqdm, or for bytes its subclass whose ``{sizes}`` field shows done/total and the rate in binary units.

    tqdm is imported here, when a terminal gets a bar: a command whose stderr is no
    terminal (CI, a pipe) never loads it (40 ms of a torch-free command's start).
    """
    from tqdm import tqdm

    if not of_bytes:
        return tqdm

    class ByteBar(tqdm):
        @property
        def format_dict(self):
            d = super().format_dict
            done, seconds = d["n"], d["elapsed"]
            rate = f", {human_bytes(done / seconds)}/s" if seconds > 0 and done else ""
            d["sizes"] = f"{human_bytes(done)}/{human_bytes(d['total'] or 0)}{rate}"
            return d

    return ByteBar
