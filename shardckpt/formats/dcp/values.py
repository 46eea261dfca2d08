"""DCP's non-tensor values (an optimizer's step, its param_groups) read without torch where plain.

DCP stores each value as a ``torch.save`` zip inside a data file. Most hold only plain
Python (numbers, strings, lists, tuples, dicts): such a pickle, checked by the same
bounds as any other (``check_torch_file``), is unpickled here with no global and no
persistent id admitted, which gives what torch's ``weights_only`` loader gives for it.
Any other value, or one that does not read so (damaged, transformed by an extension,
refused), is left to DCP's own loader (``loader.py``), which also words its error.
"""

from __future__ import annotations

import io
import pickle
from collections import OrderedDict
from pathlib import Path

from shardckpt.codecs.pickle_bounds import check_torch_file
from shardckpt.codecs.pickle_scan import torch_pickles
from shardckpt.core.files import source_stream

REFUSED = object()
"""What ``DcpReader.stored_value`` is told a value loaded to when the safe loader refused it."""


class NotPlain(Exception):
    """A value this module does not read: DCP's loader reads it instead."""


class _PlainUnpickler(pickle.Unpickler):
    """Builds plain Python only: any global (but ``OrderedDict``) or persistent id is ``NotPlain``."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        raise NotPlain(f"{module}.{name}")

    def persistent_load(self, pid):
        raise NotPlain("a tensor's storage")


def stored_bytes(src: Path, info) -> bytes:
    """Return the bytes of the item ``info`` (a ``_StorageInfo``) in its data file; ``NotPlain`` where transformed."""
    if info.transform_descriptors:
        raise NotPlain("stored through an extension")
    try:
        with source_stream(src / info.relative_path) as stream:
            stream.seek(info.offset)
            data = stream.read(info.length)
    except OSError as exc:
        raise NotPlain(str(exc)) from None
    if len(data) != info.length:
        raise NotPlain("cut short")
    return data


def plain_value(stored: bytes, file: Path) -> object:
    """Return the value the ``torch.save`` zip ``stored`` holds; ``NotPlain`` unless plain and sound."""
    try:
        stream = io.BytesIO(stored)
        check_torch_file(stream, file)
        with torch_pickles(stream) as pickles:
            if len(pickles) != 1:
                raise NotPlain("not one pickle")
            return _PlainUnpickler(pickles[0]).load()
    except NotPlain:
        raise
    except Exception as exc:  # noqa: BLE001 - DCP's loader reads it again and words the error
        raise NotPlain(str(exc)) from None
