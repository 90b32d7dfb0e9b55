#!/usr/bin/env bash
# Builds the Python 3.12 virtualenv that NeMo Gym's servers run in, once, and prints its path.
#
# NeMo Gym needs Python >= 3.12 while miles runs on 3.11, so its servers live in their own venv.
# The venv is cached (default ~/.cache/miles/nemo-gym-<version>); a finished build is marked by a
# stamp file, so calling this again returns at once. Concurrent callers wait on a lock.
#
# Environment: NEMO_GYM_VERSION (default 0.4.0), NEMO_GYM_PYTHON (a python3.12 interpreter;
# default pyenv's 3.12.1 by full path, since the pyenv shim may refuse to run), NEMO_GYM_VENV
# (the venv folder).
set -euo pipefail
VERSION=${NEMO_GYM_VERSION:-0.4.0}
if [ -z "${NEMO_GYM_PYTHON:-}" ]; then
  NEMO_GYM_PYTHON=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")/versions/3.12.1/bin/python3.12
fi
VENV=${NEMO_GYM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/miles/nemo-gym-$VERSION}
STAMP="$VENV/.miles-ready-$VERSION"
if [ -f "$STAMP" ]; then echo "$VENV"; exit 0; fi
if [ ! -x "$NEMO_GYM_PYTHON" ]; then
  echo "make_venv.sh: no Python 3.12 at $NEMO_GYM_PYTHON; set NEMO_GYM_PYTHON to one" >&2
  exit 2
fi
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9
if [ -f "$STAMP" ]; then echo "$VENV"; exit 0; fi
rm -rf "$VENV"  # a half-built venv from an interrupted run
"$NEMO_GYM_PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --disable-pip-version-check -q "nemo-gym==$VERSION" >&2
touch "$STAMP"
echo "$VENV"
