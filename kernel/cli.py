"""``miles`` command line: train, eval, export, serve, plugins."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from . import checkpoint
from .errors import MilesError, PluginError
from .plugins import KINDS, call_first, make_plugin_manager, plugin_table


def _load(args: argparse.Namespace):
    """Plugin manager + validated config, with every config problem reported at once."""
    from .config import apply_overrides, read_yaml, resolve

    data = apply_overrides(read_yaml(args.config), args.overrides)
    launch = list(args.plugin or []) + [p for p in (data.get("plugins") or []) if isinstance(p, str)]
    pm = make_plugin_manager(extra=launch)
    return pm, resolve(pm, data, source=args.config)


def cmd_train(args: argparse.Namespace) -> int:
    from .loop import Loop

    pm, cfg = _load(args)
    if cfg.name("launcher") and not os.environ.get("MILES_LAUNCHED"):
        launcher = pm.create("launchers", cfg.name("launcher"), cfg.settings("launcher"))
        return launcher.launch(cfg, pm, list(args.plugin or []) + cfg.plugins)
    try:
        history = Loop(pm, cfg).run()
    except KeyboardInterrupt:
        print(f"interrupted; rerun the same command to resume from the last checkpoint in "
              f"{cfg.run.out_dir}", file=sys.stderr)
        return 130
    evals = [h["eval_accuracy"] for h in history if "eval_accuracy" in h]
    if evals:
        print(f"done: {cfg.run.steps} steps in {cfg.run.out_dir}; eval_accuracy {evals[0]:.3f} -> {evals[-1]:.3f}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from .loop import Loop

    loop = Loop(*_load(args))
    loop.build()
    found = checkpoint.latest(loop.cfg.run.out_dir)
    loop.new_trainer(found)
    loop.sync()
    print(json.dumps({"step": found[1]["step"] if found else None, **loop.evaluate()}))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Newest checkpoint of a run -> a Hugging Face model folder (config, safetensors, tokenizer)."""
    from .loop import Loop

    cfg_file = Path(args.run_dir) / "config.yaml"
    if not cfg_file.is_file():
        raise MilesError(f"{args.run_dir} is not a run folder (no config.yaml); pass the run.out_dir of a run")
    found = checkpoint.latest(args.run_dir)
    if not found:
        raise MilesError(f"{args.run_dir} has no checkpoint yet; train first")
    args.config, args.overrides = str(cfg_file), [f"run.out_dir={args.run_dir}"]
    loop = Loop(*_load(args))
    loop.build(with_engine=False)
    loop.new_trainer(found)
    if not hasattr(loop.p.spec, "save_pretrained"):
        raise MilesError(f"model spec {loop.cfg.name('model')!r} cannot export Hugging Face folders")
    loop.p.spec.save_pretrained(loop.p.trainer.named_weights(), loop.p.tokenizer, args.to)
    print(f"exported step {found[1]['step']} of {args.run_dir} to {args.to}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """A model folder behind SGLang's HTTP API, through the ``miles_serve`` hook (engine-agnostic)."""
    from .config import apply_overrides

    if args.host not in ("127.0.0.1", "::1", "localhost") and not args.api_key:
        raise MilesError(f"--host {args.host} exposes the server beyond this machine: pass "
                         f"--api-key KEY (clients send 'Authorization: Bearer KEY'), or bind 127.0.0.1")
    pm = make_plugin_manager(extra=args.plugin or [])
    try:
        code = call_first(pm, "miles_serve", model_dir=args.model_dir, host=args.host, port=args.port,
                          api_key=args.api_key, settings=apply_overrides({}, args.overrides))
    except PluginError as e:  # a user error (bad folder, setting, port) reads better unwrapped
        if isinstance(e.__cause__, MilesError) and not isinstance(e.__cause__, PluginError):
            raise e.__cause__ from None
        raise
    if code is None:
        raise MilesError("no installed plugin implements miles_serve; pip install miles-plugin-torch-engine")
    return code


def cmd_plugins(args: argparse.Namespace) -> int:
    pm = make_plugin_manager(extra=args.plugin or [])
    rows = plugin_table(pm)
    components = {k: {n: c.plugin for n, c in pm.registry(k).items()} for k in KINDS}
    if args.json:
        print(json.dumps({"plugins": rows, "components": components}, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table("plugin", "distribution", "version", "hooks", title="miles plugins")
    for r in rows:
        table.add_row(r["name"], r["distribution"] or r["origin"], r["version"] or "",
                      ", ".join(h.removeprefix("miles_") for h in r["hooks"]))
    console = Console()
    console.print(table)
    for kind, comps in components.items():
        if comps:
            console.print(f"[bold]{kind}[/]: " + ", ".join(sorted(comps)))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="miles", description="RL post-training as plugins")
    sub = p.add_subparsers(dest="command", required=True)
    for name, fn, helptext in (("train", cmd_train, "run (or resume) a training run"),
                               ("eval", cmd_eval, "evaluate the newest checkpoint of a run")):
        sp = sub.add_parser(name, help=helptext)
        sp.add_argument("config", help="YAML config file")
        sp.add_argument("overrides", nargs="*", help="key.sub=value overrides")
        sp.set_defaults(fn=fn)
    sp = sub.add_parser("export", help="write a run's newest checkpoint as a Hugging Face folder")
    sp.add_argument("run_dir", help="the run's out_dir")
    sp.add_argument("--to", required=True, help="destination folder")
    sp.set_defaults(fn=cmd_export)
    sp = sub.add_parser("serve", help="serve a Hugging Face model folder over SGLang's HTTP API")
    sp.add_argument("model_dir", help="Hugging Face model folder (e.g. written by miles export)")
    sp.add_argument("--port", type=int, required=True, help="TCP port (0 picks a free one)")
    sp.add_argument("--host", default="127.0.0.1", help="address to bind (not loopback: needs --api-key)")
    sp.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every request")
    sp.add_argument("overrides", nargs="*", help="engine settings as key=value (e.g. dtype=bfloat16)")
    sp.set_defaults(fn=cmd_serve)
    sp = sub.add_parser("plugins", help="list discovered plugins and components")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(fn=cmd_plugins)
    for sp in sub.choices.values():
        sp.add_argument("--plugin", action="append", help="launch-time plugin module or .py file")
    return p


def main(argv: list[str] | None = None) -> Any:
    p = parser()
    args, rest = p.parse_known_args(argv)  # overrides may come after --plugin options
    if rest and (not hasattr(args, "overrides") or any("=" not in r or r.startswith("-") for r in rest)):
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    if rest:
        args.overrides += rest
    try:
        return args.fn(args)
    except MilesError as e:
        print(f"miles: error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
