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

# Two pytest-xdist workers, each taking whole test files (module fixtures such as the
# streaming test's 1.25 GiB source are made once): most tests wait on a subprocess or
# on gloo ranks for much of their time, so two workers about halve the suite on 2
# cores. SHARDCKPT_TEST_WORKERS=0 runs every test in this one process (pdb, -s).
workers="${SHARDCKPT_TEST_WORKERS:-2}"
if [[ "$workers" != "0" ]]; then
    set -- -n "$workers" --dist loadfile "$@"
fi

rc=0
"$py" -m pytest -q "$@" || rc=$?
if [[ $rc -eq 5 ]]; then
    # pytest's "no tests collected" must not pass quietly: an empty suite is a bug.
    echo "test: pytest collected no tests (exit 5); treating that as a failure" >&2
fi
exit "$rc"
