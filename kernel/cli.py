"""``miles`` command line: train, plugins, and the commands plugins add (``eval``, ``serve``, ``export``)."""
from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
from pathlib import Path
from typing import Any

import miles.runfolder as runfolder

from .errors import MilesError, PluginError
from .plugins import _CALLING, KINDS, make_plugin_manager, plugin_table

# a trainer rank that a launcher started (``on``) and the status its ``miles train`` ends with
_LAUNCHED_RANK: dict[str, Any] = {}


def _leave_launched_rank() -> None:
    """The last exit handler of a launcher-started trainer rank: after the other exit handlers and
    Python's thread shutdown, flush and leave without interpreter teardown.

    A gloo worker thread of torch.distributed may still be releasing the run's last collective
    (e.g. the final ``broadcast_object``) when the main thread exits; that release drops Python
    tensors and so takes the GIL, and a thread that takes the GIL once teardown has begun is ended
    by ``pthread_exit`` inside C++ code: ``terminate called without an active exception``, SIGABRT
    after a finished run. Leaving here, before teardown, is the only exit that cannot race with it:
    the process groups are never destroyed for certain (FSDP2's DTensors keep them alive)."""
    if not _LAUNCHED_RANK.get("on"):
        return
    if "logging" in sys.modules:
        import logging

        logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or its reader has gone
            pass
    os._exit(_LAUNCHED_RANK.get("code", 1))


def load(config: str, overrides: list[str], plugins: list[str], *, trust_listed: bool = True) -> tuple[Any, Any]:
    """Plugin manager + validated config of a run (``plugins``: launch-time modules besides the config's
    own ``plugins:``), with every config problem reported at once. ``trust_listed=False`` (a run
    folder's config): only the ``plugins:`` entries that ``plugins`` names again are imported."""
    from .config import apply_overrides, read_yaml, resolve

    if Path(config).is_dir():
        raise MilesError(f"{config} is a folder; pass a YAML config file")
    try:
        data = apply_overrides(read_yaml(config), overrides)
    except UnicodeDecodeError as e:
        raise MilesError(f"{config} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    listed = data.get("plugins") if isinstance(data.get("plugins"), list) else []
    listed = [p for p in listed if isinstance(p, str)]
    if not trust_listed:
        listed = runfolder.folder_plugins(listed, plugins, False, config)
    pm = make_plugin_manager(extra=list(plugins) + listed)
    return _checked(pm), resolve(pm, data, source=config)


def _checked(pm: Any) -> Any:
    """A ``@hookimpl`` whose name is no miles hook (a typo) is an error in a launch-time plugin and a
    warning in an installed one (it may target a newer miles), never silently ignored."""
    import difflib

    hooks = [n for n in dir(pm.hook) if n.startswith("miles_") and getattr(pm.hook, n).spec]
    for name in sorted(n for n in dir(pm.hook) if n.startswith("miles") and n not in hooks):
        for impl in getattr(pm.hook, name).get_hookimpls():
            if impl.optionalhook:
                continue
            near = difflib.get_close_matches(name, hooks, n=1)
            text = (f"plugin {pm.describe(impl.plugin)} implements unknown hook {name!r}"
                    + (f"; did you mean {near[0]}?" if near else "; see miles.hookspecs"))
            if pm.origins.get(impl.plugin_name) == impl.plugin_name:  # --plugin or plugins: entry
                raise PluginError(text)
            print(f"miles: warning: {text}", file=sys.stderr)
    for plugin in sorted(pm.get_plugins(), key=pm.describe):  # a hook function without @hookimpl is never called
        for attr, fn in sorted(vars(plugin).items()) if hasattr(plugin, "__dict__") else ():
            if attr in hooks and callable(fn) and not hasattr(fn, "miles_impl") \
                    and getattr(fn, "__module__", None) == getattr(plugin, "__name__", None):
                print(f"miles: warning: plugin {pm.describe(plugin)} defines {attr} without @hookimpl, so "
                      f"miles never calls it; decorate it with @miles.hookimpl", file=sys.stderr)
    return pm


def cmd_train(args: argparse.Namespace) -> int:
    from .loop import Loop

    pm, cfg = load(args.config, args.overrides, args.plugin or [])
    if cfg.name("launcher") and not os.environ.get("MILES_LAUNCHED"):
        runfolder.check_out_dir(cfg.run.out_dir)  # before the launcher writes its logs there
        note, finished = runfolder.check_resume(cfg.run.out_dir, cfg.resolved(), cfg.run.steps)
        if note:
            print(note)
        if finished:
            return 0
        launcher = pm.create("launchers", cfg.name("launcher"), cfg.settings("launcher"))
        return launcher.launch(cfg, pm, list(args.plugin or []) + cfg.plugins)
    if os.environ.get("MILES_LAUNCHED") and "RANK" in os.environ:
        _LAUNCHED_RANK["on"] = True  # see _leave_launched_rank
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


def plugin_commands(sub: Any, pm: Any) -> None:
    """The ``miles <name>`` subcommands plugins add through ``miles_register_commands``."""
    def register(name: str, help: str, add_arguments: Any, run: Any) -> None:
        if name in sub.choices:
            raise PluginError(f"plugin {_CALLING.get()} registers the command {name!r}, which already "
                              f"exists; rename it")
        sp = sub.add_parser(name, help=help)
        add_arguments(sp)
        sp.set_defaults(fn=run)
    pm.hook.miles_register_commands(register=register)


def parser(pm: Any = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="miles", description="RL post-training as plugins")
    sub = p.add_subparsers(dest="command", required=True)
    sp = sub.add_parser("train", help="run (or resume) a training run")
    sp.add_argument("config", help="YAML config file")
    sp.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    sp.set_defaults(fn=cmd_train)
    sp = sub.add_parser("plugins", help="list discovered plugins and components")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(fn=cmd_plugins)
    if pm is not None:
        plugin_commands(sub, pm)
    for sp in sub.choices.values():
        sp.add_argument("--plugin", action="append", help="launch-time plugin module or .py file")
    return p


def main(argv: list[str] | None = None) -> Any:
    try:
        p = parser(make_plugin_manager())  # installed plugins may add commands
    except MilesError as e:
        print(f"miles: error: {e}", file=sys.stderr)
        return e.exit_code
    args, rest = p.parse_known_args(argv)  # overrides may come after --plugin options
    if rest and (not hasattr(args, "overrides") or any("=" not in r or r.startswith("-") for r in rest)):
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    if rest:
        args.overrides += rest
    try:
        code = args.fn(args)
    except MilesError as e:
        print(f"miles: error: {e}", file=sys.stderr)
        code = e.exit_code
    _LAUNCHED_RANK["code"] = code if isinstance(code, int) else int(code is not None)  # as sys.exit
    return code


if __name__ == "__main__":
    # registered before torch and the plugins are imported: it runs after their exit handlers
    atexit.register(_leave_launched_rank)
    sys.exit(main())
