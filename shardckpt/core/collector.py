"""Python's cycle collector kept off the millions of objects a DCP ``.metadata`` unpickles to.

Unpickling the ``.metadata`` of a 1,024-rank save (145 MB, 1.16 million chunks) makes
about 30 million objects, and the collector, counting allocations, walks every one of
them again and again: while they are made (12.5 s to unpickle, 6.8 s with it off), and
in every collection after that reaches them, for as long as they live. Converting that
save took 211 s with the collector on and 168 s with it off.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """Inside, the cycle collector does not run; as it was on leaving."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def spared_while(owner: object) -> None:
    """Leave every object alive now out of the collector's walks (``gc.freeze``) until ``owner`` dies.

    They are still freed when nothing refers to them; only a cycle among them waits for
    ``owner``'s death to be found.
    """
    gc.freeze()
    weakref.finalize(owner, gc.unfreeze)
