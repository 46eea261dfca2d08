"""Write ``hashes.json``: the SHA-256 of every file of every golden output, for this torch release.

Run from the repository root with the code the goldens pin (README.md here):

    PYTHONPATH=$PWD:$PWD/tests python tests/goldens/outputs/make.py

It converts ``fsdp2-dcp/`` into each case of ``tests/output_goldens.py`` in one process
(``api.convert``, standalone) and keeps the other releases' hashes as they are.
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import output_goldens  # noqa: E402
import reference  # noqa: E402, F401  (makes examples/make_checkpoint.py importable for --model)
from rank_bytes import file_hashes  # noqa: E402

from shardckpt import api  # noqa: E402


def main() -> None:
    """Convert the source into every case; write their hashes under this torch release."""
    hashes = output_goldens.recorded() if output_goldens.HASHES.exists() else {}
    mine = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case, request in output_goldens.cases().items():
            dst = Path(tmp) / request.dst
            api.convert(replace(request, dst=dst))
            mine[case] = file_hashes(dst)
            print(f"{case}: {len(mine[case])} files", file=sys.stderr)
    hashes[output_goldens.torch_release()] = mine
    output_goldens.HASHES.write_text(json.dumps(hashes, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
