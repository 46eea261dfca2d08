"""Pickles that name another library's classes without importing it: ``torch.save`` through them.

A checkpoint another library loads with its own classes in it (DeepSpeed's loss scaler,
its ``ZeroStageEnum``) must pickle those classes by name. The standard pickler looks a
class up in its module to check it before naming it, which needs the library; the
pickler here writes the name itself for the stand-ins below, as the library's own
save does, and pickles everything else as the standard one:

- ``Named("pkg.mod", "Class")``: the class (``GLOBAL pkg.mod Class``);
- ``Instance(named, state)``: an object of it, as ``object.__reduce_ex__(2)`` pickles one
  (``NEWOBJ`` with no arguments, then ``BUILD`` with its ``__dict__``);
- ``Call(named, args)``: the class called with ``args`` (an ``Enum`` member, a dataclass
  rebuilt by its constructor).

``torch.save(obj, f, pickle_module=MODULE)`` uses it.
"""

from __future__ import annotations

import pickle
import types
from dataclasses import dataclass


@dataclass(frozen=True)
class Named:
    """A class of another library, named by module and qualified name."""

    module: str
    name: str

    def __call__(self, *args, **kwargs):
        raise TypeError(f"{self.module}.{self.name} is a name to pickle, not a class to call")


@dataclass(eq=False)
class Instance:
    """An object of ``cls`` whose ``__dict__`` is ``state``."""

    cls: Named
    state: dict


@dataclass(eq=False)
class Call:
    """The object ``cls(*args)``."""

    cls: Named
    args: tuple


class _Pickler(pickle._Pickler):  # type: ignore[name-defined]
    """The pure-Python pickler, writing the stand-ins as the library's own objects."""

    def save(self, obj, save_persistent_id=True):
        if isinstance(obj, Named):
            self._global(obj)
        elif isinstance(obj, Instance):
            self._global(obj.cls)
            self.save(())
            self.write(pickle.NEWOBJ)
            self.memoize(obj)
            self.save(obj.state)
            self.write(pickle.BUILD)
        elif isinstance(obj, Call):
            self._global(obj.cls)
            self.save(tuple(obj.args))
            self.write(pickle.REDUCE)
            self.memoize(obj)
        else:
            super().save(obj, save_persistent_id)

    def _global(self, named: Named) -> None:
        memo = self.memo.get(id(named))
        if memo is not None:
            self.write(self.get(memo[0]))
            return
        self.write(pickle.GLOBAL + f"{named.module}\n{named.name}\n".encode())
        self.memoize(named)


MODULE = types.ModuleType("shardckpt_foreign_pickle")
"""What ``torch.save`` takes as ``pickle_module``."""
MODULE.Pickler = _Pickler  # type: ignore[attr-defined]
MODULE.Unpickler = pickle.Unpickler  # type: ignore[attr-defined]
