#!/usr/bin/env bash
# Set up .venv if needed, then run the test suite. Extra arguments go to pytest,
# e.g. `bash scripts/test.sh tests/unit -k optim`.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

# The tests save and load with the trainer libraries too (pyproject's trainers extra).
SHARDCKPT_EXTRAS="${SHARDCKPT_EXTRAS:-test,trainers}" bash scripts/setup.sh
py="${SHARDCKPT_VENV:-$root/.venv}/bin/python"

if [[ "${CI:-}" == "true" ]]; then
    # CI logs are files, not terminals: no colour codes, no progress bars.
    export NO_COLOR=1 PY_COLORS=0 TQDM_DISABLE=1 PYTHONUNBUFFERED=1
    set -- --color=no "$@"
fi

rc=0
"$py" -m pytest -q "$@" || rc=$?
if [[ $rc -eq 5 ]]; then
    # pytest's "no tests collected" must not pass quietly: an empty suite is a bug.
    echo "test: pytest collected no tests (exit 5); treating that as a failure" >&2
fi
exit "$rc"
