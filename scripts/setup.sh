#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv. Safe to re-run.
#
#   PYTHON                 interpreter that creates the venv (default: python3)
#   SHARDCKPT_VENV         where the venv lives (default: <repo>/.venv)
#   SHARDCKPT_TORCH_SPEC   torch requirement installed when the venv has no torch
#                          (default: torch==2.13.0, the CPU wheel on the local index)
#   SHARDCKPT_EXTRAS       pyproject extras installed with the package (default: test;
#                          scripts/test.sh asks for test,trainers,s3,s3-server); extras already
#                          installed in the venv are kept, never reinstalled
#
# torch is installed first and pinned, on purpose: pyproject.toml asks for a range,
# and pip resolving that range on a machine without torch would pull gigabytes of
# CUDA packages.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

python="${PYTHON:-python3}"
venv="${SHARDCKPT_VENV:-$root/.venv}"
torch_spec="${SHARDCKPT_TORCH_SPEC:-torch==2.13.0}"
extras="${SHARDCKPT_EXTRAS:-test}"
stamp="$venv/.shardckpt-setup"

log() { printf 'setup: %s\n' "$*" >&2; }

pip_log="$(mktemp)"
constraints="$(mktemp)"
trap 'rm -f "$pip_log" "$constraints"' EXIT

# pip's chatter (index warnings, progress) is kept out of the way; on failure the
# whole of it is shown, since that is where the reason is.
pip_install() {
    if ! "$venv/bin/python" -m pip install --disable-pip-version-check "$@" >"$pip_log" 2>&1; then
        cat "$pip_log" >&2
        log "pip install $* failed (output above)"
        exit 1
    fi
}

# Asks the installed metadata, not `import torch`: pip's view of what is installed is
# what decides whether it would fetch a torch, and it answers in ~0.1 s instead of ~2 s.
installed_version() {
    "$venv/bin/python" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' \
        "$1" 2>/dev/null
}

if [[ ! -x "$venv/bin/python" ]]; then
    log "creating $venv with $("$python" --version 2>&1)"
    "$python" -m venv "$venv"
fi

if ! torch_version="$(installed_version torch)"; then
    log "installing $torch_spec (first run only)"
    pip_install "$torch_spec"
    torch_version="$(installed_version torch)"
fi

# True when `import shardckpt`, run outside the repo, would load this checkout. The
# editable install maps the package directories that existed when it ran, so it must
# be redone if the package appeared later (or the venv was made for another clone).
editable_ok() {
    (cd / && "$venv/bin/python" -c '
import importlib.util, os, sys
spec = importlib.util.find_spec("shardckpt")
dirs = [os.path.realpath(d) for d in (spec.submodule_search_locations or [])] if spec else []
sys.exit(0 if os.path.join(os.path.realpath(sys.argv[1]), "shardckpt") in dirs else 1)
' "$root") >/dev/null 2>&1
}

# Reinstall only when pyproject.toml or the torch underneath changed, when the
# editable install does not point here, or when an extra asked for is not installed.
# The stamp's first line hashes pyproject.toml and torch, its second lists the extras
# installed: a venv that has more extras than asked for is left as it is, so switching
# between scripts/demo.sh (test) and scripts/test.sh (test,trainers) installs nothing.
want="$(cat pyproject.toml <(echo "torch $torch_version") | sha256sum | cut -d' ' -f1)"
have="$(sed -n 1p "$stamp" 2>/dev/null || true)"
have_extras="$(sed -n 2p "$stamp" 2>/dev/null || true)"
missing=""
for extra in ${extras//,/ }; do
    [[ ",$have_extras," == *",$extra,"* ]] || missing+="$extra "
done
if [[ "$want" == "$have" && -z "$missing" ]] && editable_ok; then
    exit 0
fi
if [[ -n "$have_extras" ]]; then
    # Keep what is there (pip would not remove it anyway), at pyproject's current pins.
    extras="$(printf '%s\n' ${extras//,/ } ${have_extras//,/ } | awk '!seen[$0]++' | paste -sd, -)"
fi

log "installing shardckpt (editable) with the extras: $extras"
# The constraint stops pip from replacing the torch installed above: a torch outside
# pyproject's range becomes a resolver error instead of a silent multi-GB download.
printf 'torch==%s\n' "$torch_version" >"$constraints"
pip_install -c "$constraints" -e ".[$extras]"
if [[ ",$extras," == *",trainers,"* ]]; then
    # torchtitan's checkpoint code needs only what the trainers extra lists; its own
    # requirements would pull ~1.5 GB of data and logging packages (see pyproject.toml).
    pip_install -c "$constraints" --no-deps torchtitan==0.3.0
    # Its model code (the llama3 and deepseek_v3 models the --map tests build) imports
    # triton at import time, even on CPU, where no kernel of it runs.
    pip_install -c "$constraints" --no-deps triton==3.9.0
fi
"$venv/bin/python" -c 'import torch' || {
    log "torch $torch_version is installed but does not import (error above)"
    exit 1
}
printf '%s\n%s\n' "$want" "$extras" >"$stamp"
log "ready: $venv (torch $torch_version)"
