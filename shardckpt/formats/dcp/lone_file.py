"""One file of a DCP checkpoint passed alone: name the directory to pass instead.

A ``__0_0.distcp`` file holds torch.save records of one rank's chunks, so it reads as
a damaged torch file; its ``.metadata`` is a pickle. Neither is a checkpoint without
the other files of its directory.
"""

from __future__ import annotations

from pathlib import Path

from shardckpt.core.errors import BadInputError
from shardckpt.formats.dcp import METADATA_FILE

DATA_SUFFIX = ".distcp"


def refuse_lone_file(path: Path) -> None:
    """Raise for a DCP data file or ``.metadata`` passed as a source on its own; return for any other file."""
    if path.suffix != DATA_SUFFIX and path.name != METADATA_FILE:
        return
    what = "the metadata" if path.name == METADATA_FILE else "one data file"
    directory = path.parent
    hint = (
        f"pass the directory '{directory}', which holds it and the other files of the save"
        if (directory / METADATA_FILE).is_file()
        else f"pass the DCP directory it came from (with its '{METADATA_FILE}' and *{DATA_SUFFIX} files)"
    )
    raise BadInputError(
        f"is {what} of a DCP checkpoint, not a checkpoint alone", path=path, hint=hint
    )
