"""``miles export``: the target is checked before anything is built; the spec writes into a temp folder
beside it, whose files then move in, so nothing the export did not write is ever removed (a non-empty
target needs ``--force``, and then only same-named files are replaced).

``--format``: a run trained for INT4 rollout (``trainer.qat: int4``) is written in the compressed-tensors
format by default (``auto``), so the folder is the INT4 model the engines served, at about a quarter
of the size; ``dense`` writes every weight in the model's dtype (rounded weights dequantized)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import miles.runfolder as runfolder
from miles import MilesError

FORMATS = ("auto", "dense", "compressed-tensors")


def add_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("run_dir", help="the run's out_dir")
    sp.add_argument("--to", required=True, help="destination folder (new or empty)")
    sp.add_argument("--force", action="store_true", help="write into a non-empty folder, replacing "
                    "same-named files only")
    sp.add_argument("--format", choices=FORMATS, default="auto",
                    help="auto (default): compressed-tensors for a trainer.qat: int4 run whose weights it "
                         "holds, else dense; dense: every weight in the model's dtype; compressed-tensors: "
                         "INT4 weights packed (needs the compressed-tensors package)")
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
    trainer = loop.new_trainer(found)
    fmt = args.format
    with runfolder.export_folder(to) as tmp:
        loop.export(str(tmp))
        packed = _compress(trainer, tmp, fmt) if fmt != "dense" else 0
    how = f", {packed} INT4 weights in the compressed-tensors format" if packed else ""
    print(f"exported step {found[1]['step']} of {args.run_dir} to {args.to}{how}")
    return 0


def _compress(trainer, folder: Path, fmt: str) -> int:
    """Pack the INT4 weights of the dense folder the spec wrote (compressed-tensors); ``auto`` keeps
    the dense folder, with a note, where that format cannot hold them. Returns how many were packed."""
    from miles.protocols import SendsPacked

    formats = trainer.packed_formats if isinstance(trainer, SendsPacked) else {}
    kinds = sorted(set(formats.values()))
    if kinds != ["int4"]:
        if fmt == "auto":
            return 0
        raise MilesError(f"--format compressed-tensors writes the INT4 weights of a trainer.qat: int4 run; this "
                         f"run's trainer rounds {'its weights to ' + ', '.join(kinds) if kinds else 'no weights'}: "
                         f"pass --format dense (or leave --format out)")
    from miles_lowp.compressed import CompressedExportError, compress_folder

    try:
        return compress_folder(folder, trainer.named_weights(), formats)
    except CompressedExportError as e:
        why = str(e)
    except ModuleNotFoundError as e:
        if not (e.name or "").startswith("compressed_tensors"):
            raise
        why = "the compressed-tensors package is not installed (pip install compressed-tensors)"
    if fmt == "auto":
        print(f"miles export: INT4 weights written dense (dequantized to the model's dtype): {why}; pass "
              f"--format dense to choose this", file=sys.stderr)
        return 0
    raise MilesError(f"--format compressed-tensors: {why}; pass --format dense for a folder with every "
                     f"weight in the model's dtype")
