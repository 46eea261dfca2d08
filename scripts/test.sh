#!/usr/bin/env bash
# Set up .venv if needed, then run the test suite. Extra arguments go to pytest,
# e.g. `bash scripts/test.sh tests/unit -k optim`.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

# The tests save and load with the trainer libraries too (pyproject's trainers extra),
# and read and write s3:// on a moto server (s3, s3-server).
SHARDCKPT_EXTRAS="${SHARDCKPT_EXTRAS:-test,trainers,s3,s3-server}" bash scripts/setup.sh
py="${SHARDCKPT_VENV:-$root/.venv}/bin/python"

if [[ "${CI:-}" == "true" ]]; then
    # CI logs are files, not terminals: no colour codes, no progress bars.
    export NO_COLOR=1 PY_COLORS=0 TQDM_DISABLE=1 PYTHONUNBUFFERED=1
    set -- --color=no "$@"
fi

# Two pytest-xdist workers, each taking whole test files (module fixtures such as the
# streaming test's 1.25 GiB source are made once): run in one process, most tests
# wait on a subprocess or on gloo ranks with a core idle. The quick tier (`-m quick`)
# runs in one process: its tests start none, and a second worker's imports cost more
# than it saves. SHARDCKPT_TEST_WORKERS=N sets the number (0: this process; pdb, -s).
workers=2
if [[ " $* " == *" -m quick "* || " $* " == *" -m quick and "* ]]; then
    workers=0
fi
workers="${SHARDCKPT_TEST_WORKERS:-$workers}"
# One intra-op thread per process: the suite runs two workers, gloo ranks and torchrun
# launches side by side on a few cores, where torch's default of a thread per core
# only makes them contend (about 10 s of the suite's 6 minutes on 2 cores). A test
# that wants another count sets it for its own processes.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
if [[ "$workers" != "0" ]]; then
    # Files in the order tests/conftest.py gives them (slowest tier first), not xdist's
    # default of the files with the most tests first, which hands out e2e's last.
    set -- -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
fi

rc=0
"$py" -m pytest -q "$@" || rc=$?
if [[ $rc -eq 5 ]]; then
    # pytest's "no tests collected" must not pass quietly: an empty suite is a bug.
    echo "test: pytest collected no tests (exit 5); treating that as a failure" >&2
fi
exit "$rc"
