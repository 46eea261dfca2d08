"""What a run may ask for, each named once: layouts, parts, optimizer key types, the buffer.

Pure constants, no torch: the CLI builds its option choices from them before any
command runs (``--help`` must not wait for torch's import).
"""

from __future__ import annotations

LAYOUTS = ("full", "sharded", "local")
"""SPEC's layouts: one whole copy, world-size-agnostic shards (DCP), per-rank files of one world size."""

ONLY = ("all", "model", "optim")
"""``--only``: the whole tree, the model part, or the optimizer part."""

OPTIM_KEYS = ("keep", "fqn", "id", "flat")
"""``--optim-keys``: optimizer state as found, keyed by FQN, by param ID, or torch's flattened form."""

DEFAULT_BUFFER_BYTES = 256 * 2**20
"""``--buffer-size``: the most tensor bytes one process holds at a time."""
