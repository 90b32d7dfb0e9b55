#!/usr/bin/env bash
# Builds (once) the virtualenv the verifiers worker runs in and prints its python's path.
# verifiers and openenv-core cannot share one environment, so verifiers lives in its own venv,
# cached under ~/.cache/miles/venvs/verifiers-<hash of the pinned requirements>; a second call
# with the same requirements only prints the path.
#   PY=python3.11 plugins/envs/verifiers/scripts/make_venv.sh   ->  /root/.cache/miles/venvs/verifiers-1a2b3c4d/bin/python
set -euo pipefail
PY="${PY:-python3.11}"
REQS="verifiers==0.4.0"
HASH=$(printf '%s\n%s\n' "$REQS" "$("$PY" -c 'import sys; print(sys.version_info[:2])')" | sha256sum | cut -c1-8)
ROOT="${MILES_VENV_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/miles/venvs}"
VENV="$ROOT/verifiers-$HASH"
mkdir -p "$ROOT"
exec 9>"$VENV.lock"  # concurrent callers (CI builds it ahead, a test asks for it) wait for one build
flock 9
if [ ! -f "$VENV/.complete" ]; then
  TMP="$VENV.tmp.$$"   # built aside and moved into place, so an interrupted build is never used
  rm -rf "$TMP"
  "$PY" -m venv "$TMP" >&2
  "$TMP/bin/python" -m pip install -q --upgrade pip >&2
  # shellcheck disable=SC2086
  "$TMP/bin/python" -m pip install -q $REQS >&2
  touch "$TMP/.complete"
  rm -rf "$VENV"
  mv "$TMP" "$VENV"
fi
echo "$VENV/bin/python"
