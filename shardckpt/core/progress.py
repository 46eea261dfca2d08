"""Progress, phase by phase: a tqdm bar on rank 0's stderr when it is a terminal, silent otherwise.

Sizes and rates are binary (KiB, MiB, GiB), as everywhere else shardckpt prints them;
tqdm's own scaling would print sizes in one system and rates in the other.
"""

from __future__ import annotations

import os
import sys

from tqdm import tqdm


def human_bytes(n: float) -> str:
    """Return ``n`` bytes as a short human string (``1.5 MiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


class Progress:
    """Counts the work of one phase at a time; draws a bar only when ``enabled`` and stderr is a terminal."""

    def __init__(self, enabled: bool = False, desc: str = ""):
        # CI logs are not terminals, but some CI runners fake one; CI=true keeps them clean too.
        self.enabled = (
            enabled
            and sys.stderr.isatty()
            and os.environ.get("CI", "").lower() not in ("1", "true")
        )
        self.desc = desc
        self._bar: tqdm | None = None
        self._bytes = True

    def begin(self, total: int, phase: str = "", unit: str = "bytes") -> None:
        """Start a phase (ending the one before) that counts towards ``total`` bytes, or files."""
        self.close()
        if not self.enabled:
            return
        self._bytes = unit == "bytes"
        desc = f"{self.desc} {phase}".strip() if phase else self.desc
        self._bar = (_ByteBar if self._bytes else tqdm)(
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
        """Remove the bar."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class _ByteBar(tqdm):
    """A bar whose ``{sizes}`` field shows done/total and the rate in binary units."""

    @property
    def format_dict(self):
        d = super().format_dict
        done, seconds = d["n"], d["elapsed"]
        rate = f", {human_bytes(done / seconds)}/s" if seconds > 0 and done else ""
        d["sizes"] = f"{human_bytes(done)}/{human_bytes(d['total'] or 0)}{rate}"
        return d
