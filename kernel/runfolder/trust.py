"""Opening a run folder never runs its code: the launch-time ``plugins:`` its ``config.yaml`` lists
are imported only when the user names them again (``--plugin``) or trusts the folder
(``--trust-run-plugins``). Run folders are shared like checkpoints, and importing a listed module
runs whatever it holds. ``miles export``, ``miles eval`` (given a run folder's config.yaml) and any
other command that reads a run folder go through :func:`folder_plugins`."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .checkpoint import RUN_FILES

TRUST_FLAG = "--trust-run-plugins"


def add_trust_flag(parser: argparse.ArgumentParser) -> None:
    """The opt-in for a command that reads a run folder (``args.trust_run_plugins``)."""
    parser.add_argument(TRUST_FLAG, action="store_true",
                        help="import the plugins the run folder's config.yaml lists (runs their code: only "
                             "for folders you trust); by default only --plugin modules are imported")


def is_run_config(config: str | Path) -> bool:
    """Whether ``config`` is a run folder's own ``config.yaml`` (it sits beside the run's files)."""
    p = Path(config)
    return p.name == "config.yaml" and any((p.parent / f).exists() for f in RUN_FILES if f != "config.yaml")


def _key(spec: str) -> str:
    """A plugin entry as compared: a ``.py`` path resolved, a dotted module name as written."""
    if spec.endswith(".py") or "/" in spec:
        return str(Path(spec).expanduser().resolve())
    return spec


def folder_plugins(listed: list[str], given: list[str], trusted: bool, source: str) -> list[str]:
    """The entries of a run folder's ``plugins:`` (``listed``, from ``source``) to import: all of them
    when ``trusted``, else only those the command line also names (``given``). The rest are left
    out, and stderr says which and how to import them."""
    if trusted:
        return list(listed)
    named = {_key(g) for g in given}
    keep = [p for p in listed if _key(p) in named]
    skipped = [p for p in listed if p not in keep]
    if skipped:
        print(f"miles: note: not importing the plugins {source} lists ({', '.join(skipped)}): a run folder "
              f"may come from anyone. Pass them with --plugin, or {TRUST_FLAG} if you trust the folder",
              file=sys.stderr)
    return keep
