"""Check that a resumed run's losses continue those of the uninterrupted run.

helper: run by reshard_and_resume.sh and ddp_to_fsdp2.sh (not an example on its own);
needs only Python, no torch.

    python examples/check_losses.py REFERENCE.json RESUMED.json [--rtol 1e-5]

Both files map a global step to its loss (what train.py --losses writes). Every step
of RESUMED must be in REFERENCE with a loss equal within ``--rtol``; the check prints
one line per step and exits 1 on any step that differs or is missing, 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import sys


def compare(reference: dict[str, float], resumed: dict[str, float], rtol: float) -> list[str]:
    """Return one line per step of ``resumed``, each ending in ``ok`` or ``DIFFERS``."""
    lines = []
    for step, loss in sorted(resumed.items(), key=lambda kv: int(kv[0])):
        ref = reference.get(step)
        if ref is None:
            lines.append(f"step {step}: resumed {loss:.7f}, no such step in the reference DIFFERS")
            continue
        ok = math.isclose(loss, ref, rel_tol=rtol, abs_tol=0.0)
        verdict = "ok (bit-exact)" if loss == ref else ("ok" if ok else "DIFFERS")
        lines.append(
            f"step {step}: uninterrupted {ref:.7f}, resumed {loss:.7f}, "
            f"diff {abs(loss - ref):.1e} {verdict}"
        )
    return lines


def main() -> int:
    """Compare the two loss files; return the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reference", help="losses of the uninterrupted run")
    parser.add_argument("resumed", help="losses of the run resumed from the converted checkpoint")
    # fp32 sums in another order (other world size, DDP vs FSDP2) move the loss by a few
    # ulps; a wrong weight or optimizer moment moves it by orders of magnitude more.
    parser.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance")
    args = parser.parse_args()
    with open(args.reference) as f:
        reference = json.load(f)
    with open(args.resumed) as f:
        resumed = json.load(f)
    if not resumed:
        print(f"check_losses: {args.resumed} holds no steps", file=sys.stderr)
        return 1
    lines = compare(reference, resumed, args.rtol)
    print("\n".join(lines))
    if any(line.endswith("DIFFERS") for line in lines):
        print(
            f"check_losses: the resumed run does not continue (rtol {args.rtol:g})", file=sys.stderr
        )
        return 1
    print(f"check_losses: the resumed run continues the uninterrupted one (rtol {args.rtol:g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
