#!/usr/bin/env bash
# Builds the Python 3.12 virtualenv that Harbor's server (harbor serve) runs in, once, and prints its path.
#
# Harbor needs Python >= 3.12 while miles runs on 3.11, so it lives in its own venv.
# The venv is cached (default ~/.cache/miles/harbor-<version>); a finished build is marked by a
# stamp file, so calling this again returns at once. Concurrent callers wait on a lock.
#
# Environment: HARBOR_VERSION (default 0.26.0), HARBOR_PYTHON (a python3.12 interpreter;
# default pyenv's 3.12.1 by full path, since the pyenv shim may refuse to run), HARBOR_VENV
# (the venv folder).
set -euo pipefail
VERSION=${HARBOR_VERSION:-0.26.0}
if [ -z "${HARBOR_PYTHON:-}" ]; then
  HARBOR_PYTHON=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")/versions/3.12.1/bin/python3.12
fi
VENV=${HARBOR_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/miles/harbor-$VERSION}
STAMP="$VENV/.miles-ready-$VERSION"
if [ -f "$STAMP" ]; then echo "$VENV"; exit 0; fi
if [ ! -x "$HARBOR_PYTHON" ]; then
  echo "make_venv.sh: no Python 3.12 at $HARBOR_PYTHON; set HARBOR_PYTHON to one" >&2
  exit 2
fi
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9
if [ -f "$STAMP" ]; then echo "$VENV"; exit 0; fi
rm -rf "$VENV"  # a half-built venv from an interrupted run
"$HARBOR_PYTHON" -m venv "$VENV"
# podman-compose >= 1.1: Harbor's podman sandbox calls it with --in-pod (Debian 12 ships 1.0.3)
# tokenizers and jinja2: the miles agent (miles_harbor_agent) tokenizes and renders chat templates with them
"$VENV/bin/python" -m pip install --disable-pip-version-check -q "harbor==$VERSION" "podman-compose>=1.1,<2" \
  "tokenizers>=0.19" "jinja2>=3.1" >&2
touch "$STAMP"
echo "$VENV"
