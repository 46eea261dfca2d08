"""Progress in bytes: a tqdm bar on rank 0's stderr when it is a terminal, silent otherwise."""

from __future__ import annotations

import os
import sys

from tqdm import tqdm


class Progress:
    """Counts bytes moved; draws a bar only when ``enabled`` and stderr is an interactive terminal."""

    def __init__(self, enabled: bool = False, desc: str = ""):
        # CI logs are not terminals, but some CI runners fake one; CI=true keeps them clean too.
        self.enabled = (
            enabled
            and sys.stderr.isatty()
            and os.environ.get("CI", "").lower() not in ("1", "true")
        )
        self.desc = desc
        self._bar: tqdm | None = None

    def begin(self, total: int) -> None:
        """Start counting towards ``total`` bytes."""
        if self.enabled:
            self._bar = tqdm(
                total=total,
                desc=self.desc,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                file=sys.stderr,
                leave=False,
                dynamic_ncols=True,
            )

    def __call__(self, n: int) -> None:
        """Advance by ``n`` bytes."""
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        """Remove the bar."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
