"""``python -m shardckpt`` whose uploads' parts go slowly and say which rank sends them: a rank under torchrun to kill mid-upload.

Run as the program of ``torchrun``: each rank writes its pid to ``$SLOW_PARTS_DIR/pid-RANK``
and, before it sends a part, ``NAME PART`` to ``$SLOW_PARTS_DIR/parts-RANK``, then waits
``$SLOW_PARTS_DELAY`` seconds; then the part goes as it would.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from shardckpt.core import uploads

out = Path(os.environ["SLOW_PARTS_DIR"])
rank = os.environ["RANK"]
(out / f"pid-{rank}").write_text(str(os.getpid()))
send = uploads.Uploads._send_part


def slow(self, name, file, number, offset, length):
    with open(out / f"parts-{rank}", "a") as log:
        log.write(f"{name} {number}\n")
    time.sleep(float(os.environ["SLOW_PARTS_DELAY"]))
    return send(self, name, file, number, offset, length)


uploads.Uploads._send_part = slow

if __name__ == "__main__":
    from shardckpt.__main__ import main

    sys.exit(main())
