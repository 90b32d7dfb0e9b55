"""``miles export``: the target is checked before anything is built; the spec writes into a temp folder
beside it, whose files then move in, so nothing the export did not write is ever removed (a non-empty
target needs ``--force``, and then only same-named files are replaced)."""
from __future__ import annotations

import argparse
from pathlib import Path

import miles.runfolder as runfolder
from miles import MilesError


def add_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("run_dir", help="the run's out_dir")
    sp.add_argument("--to", required=True, help="destination folder (new or empty)")
    sp.add_argument("--force", action="store_true", help="write into a non-empty folder, replacing "
                    "same-named files only")
    runfolder.add_trust_flag(sp)


def run(args: argparse.Namespace) -> int:
    from miles.cli import load
    from miles.loop import Loop

    run_dir, to = Path(args.run_dir), Path(args.to)
    cfg_file = run_dir / "config.yaml"
    if not cfg_file.is_file():
        raise MilesError(f"{args.run_dir} is not a run folder (no config.yaml); pass the run.out_dir of a run")
    runfolder.check_export_target(run_dir, to, args.force)
    found = runfolder.latest(args.run_dir)
    if not found:
        raise MilesError(f"{args.run_dir} has no intact checkpoint; train first")
    loop = Loop(*load(str(cfg_file), [f"run.out_dir={args.run_dir}"], args.plugin or [],
                      trust_listed=args.trust_run_plugins))
    loop.build(with_engine=False)
    loop.new_trainer(found)
    with runfolder.export_folder(to) as tmp:
        loop.export(str(tmp))
    print(f"exported step {found[1]['step']} of {args.run_dir} to {args.to}")
    return 0
