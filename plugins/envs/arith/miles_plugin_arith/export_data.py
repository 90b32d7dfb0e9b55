"""Write the arith env's data out as dataset files, for supervised training from a file.

``python -m miles_plugin_arith.export_data OUT [--digits 2] [--teacher-carry-accuracy 1.0]``
writes ``OUT/train.jsonl`` (the teacher's demonstrations: ``prompt``, ``response``, ``label``)
and ``OUT/eval.jsonl`` (the held-out problems with their exact answers). ``--format parquet``
writes ``.parquet`` files instead. The split and the teacher's mistakes depend only on the env
settings (``data_seed``), so the same settings always give the same files, and the eval file
never shares a problem with the train file.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

from .config import ArithConfig

# the plain format's data is what gets exported; these keys are the chat format's (or the target)
CHAT_ONLY = {"export_dir", "format", "op", "instruction", "system_prompt"}


def rows(env, split: str) -> list[dict]:
    """``train``: one row per demonstration (the teacher's answer, right or wrong); ``eval``:
    one row per held-out problem with its exact answer."""
    if split == "train":
        return [{"prompt": t.prompt, "response": r, "label": t.label} for t, r in env.demonstrations()]
    return [{"prompt": t.prompt, "response": t.label, "label": t.label} for t in env.tasks("eval")]


def export(env, out_dir: str, fmt: str = "jsonl") -> dict[str, str]:
    """Write ``train`` and ``eval`` files into ``out_dir`` atomically (a temporary folder renamed
    into place), so a half-written export is never read. Returns split -> file path."""
    out = Path(out_dir)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for split in ("train", "eval"):
        data = rows(env, split)
        path = tmp / f"{split}.{fmt}"
        if fmt == "jsonl":
            path.write_text("".join(json.dumps(r) + "\n" for r in data))
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(data), path)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return {split: str(out / f"{split}.{fmt}") for split in ("train", "eval")}


def ensure_exported(env, out_dir: str, fmt: str = "jsonl") -> None:
    """``export`` unless ``out_dir`` already holds both files (written by the same settings:
    a marker file records them, and different settings rewrite the folder)."""
    marker = Path(out_dir) / "arith.json"
    settings = env.cfg.model_dump(exclude={"export_dir"})
    if marker.is_file() and json.loads(marker.read_text()) == settings and all(
            (Path(out_dir) / f"{s}.{fmt}").is_file() for s in ("train", "eval")):
        return
    export(env, out_dir, fmt)
    marker.write_text(json.dumps(settings))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m miles_plugin_arith.export_data", description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="output folder (created; replaced if it exists)")
    p.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl")
    for name, field in ArithConfig.model_fields.items():
        if name in CHAT_ONLY:
            continue
        p.add_argument(f"--{name.replace('_', '-')}", type=type(field.default), default=field.default,
                       help=field.description)
    args = p.parse_args(argv)
    from .env import ArithEnv

    settings = {k: v for k, v in vars(args).items() if k not in ("out", "format")}
    files = export(ArithEnv(ArithConfig(**settings)), args.out, args.format)
    for split, path in files.items():
        print(f"{split}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
