"""``miles eval``: the run is built as ``miles train`` builds it (same config, overrides and
launch-time plugins), its trainer loads the newest checkpoint and pushes the weights to the engine,
and the loop's own evaluation runs, so the figures match the run's ``eval_*`` metrics."""
from __future__ import annotations

import argparse
import json

import miles.runfolder as runfolder


def add_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("config", help="YAML config file")
    sp.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    runfolder.add_trust_flag(sp)


def run(args: argparse.Namespace) -> int:
    from miles.cli import load
    from miles.loop import Loop

    # a run folder's own config.yaml may come from anyone: its plugins: are imported only on request
    trusted = args.trust_run_plugins or not runfolder.is_run_config(args.config)
    loop = Loop(*load(args.config, args.overrides, args.plugin or [], trust_listed=trusted))
    loop.build()
    found = runfolder.latest(loop.cfg.run.out_dir)  # none: the freshly initialised model
    loop.new_trainer(found)
    loop.sync()
    print(json.dumps({"step": found[1]["step"] if found else None, **loop.evaluate()}))
    return 0
