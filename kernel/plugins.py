"""Plugin manager: entry-point discovery, launch-time modules, and component registries."""
from __future__ import annotations

import contextlib
import importlib
import importlib.metadata as md
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pluggy

from . import hookspecs
from .errors import PluginError

GROUP = "miles.plugins"
KINDS = ("engines", "trainers", "transports", "algorithms", "envs", "model_specs", "launchers", "loggers", "modes")
# config section -> registry kind, for sections that select a component by ``name``
SECTION_KINDS = {"model": "model_specs", "env": "envs", "engine": "engines", "algorithm": "algorithms",
                 "trainer": "trainers", "sync": "transports", "launcher": "launchers"}


@dataclass
class Component:
    name: str
    factory: Callable[..., Any]
    config: Any  # pydantic model class or None
    plugin: str  # who registered it


class MilesPluginManager(pluggy.PluginManager):
    """A pluggy manager that also remembers where each plugin came from."""

    def __init__(self):
        super().__init__("miles")
        self.add_hookspecs(hookspecs)
        self.origins: dict[str, str] = {}  # plugin name -> "dist miles-plugin-x 0.1" or file path
        self._registries: dict[str, dict[str, Component]] | None = None

    def describe(self, plugin: object) -> str:
        name = self.get_name(plugin) or repr(plugin)
        return self.origins.get(name, name)

    def registry(self, kind: str) -> dict[str, Component]:
        """Components of ``kind`` (e.g. ``"engines"``), collected from the registration hooks."""
        if self._registries is None:
            self._registries = {k: self._collect(k) for k in KINDS}
        return self._registries[kind]

    def _collect(self, kind: str) -> dict[str, Component]:
        found: dict[str, Component] = {}
        for impl in getattr(self.hook, f"miles_register_{kind}").get_hookimpls():
            who = self.describe(impl.plugin)

            def register(name: str, factory: Callable[..., Any], config: Any = None, _who=who) -> None:
                if name in found:
                    raise PluginError(f"{kind[:-1]} {name!r} is registered twice: by {found[name].plugin} "
                                      f"and by {_who}; uninstall or disable one of them")
                found[name] = Component(name, factory, config, _who)

            call_hook(impl, who, f"miles_register_{kind}", register=register)
        return found

    def create(self, kind: str, name: str, cfg: Any, **context: Any) -> Any:
        comp = self.registry(kind)[name]
        try:
            return comp.factory(cfg, **context)
        except ImportError as e:
            raise PluginError(f"{kind[:-1]} {name!r} from {comp.plugin} needs a package that is not "
                              f"installed: {e}. Install it (pip install {e.name or '...'})") from e


def call_hook(impl: Any, who: str, hook_name: str, **kwargs: Any) -> Any:
    """Call one hookimpl with the subset of ``kwargs`` it accepts, naming the plugin on error."""
    try:
        return impl.function(**{a: kwargs[a] for a in impl.argnames})
    except PluginError:
        raise
    except Exception as e:
        raise PluginError(f"plugin {who} failed in {hook_name}: {type(e).__name__}: {e}") from e


def make_plugin_manager(extra: list[str] = (), autoload: bool | None = None,
                        allow: list[str] | None = None) -> MilesPluginManager:
    """A fresh plugin manager (there is no global one).

    ``extra``: launch-time plugins (dotted module names or paths to ``.py`` files).
    ``autoload``: load entry points of group ``miles.plugins`` (default: unless the environment
    variable ``MILES_DISABLE_PLUGIN_AUTOLOAD`` is set). ``allow``: only these entry-point names
    or distributions (default: env ``MILES_PLUGINS``, comma-separated, or all).
    """
    pm = MilesPluginManager()
    from . import builtin

    _register(pm, builtin, "miles.builtin", "miles (built-in)")
    if autoload is None:
        autoload = not os.environ.get("MILES_DISABLE_PLUGIN_AUTOLOAD")
    if allow is None and os.environ.get("MILES_PLUGINS"):
        allow = [a.strip() for a in os.environ["MILES_PLUGINS"].split(",") if a.strip()]
    if autoload:
        for ep in _entry_points():
            dist = ep.dist.name if ep.dist else "?"
            if allow is not None and ep.name not in allow and dist not in allow:
                continue
            origin = f"{dist} {ep.dist.version if ep.dist else ''}".strip()
            try:
                module = ep.load()
            except Exception as e:
                raise PluginError(f"plugin {ep.name!r} from distribution {origin} failed to import: "
                                  f"{type(e).__name__}: {e}. Reinstall it, or set "
                                  f"MILES_PLUGINS to an allow-list that leaves it out") from e
            _register(pm, module, ep.name, f"{ep.name} ({origin})")
    for spec in extra:
        module, origin = load_module(spec)
        _register(pm, module, origin, origin)
    return pm


def _entry_points():
    by_name: dict[str, Any] = {}
    for ep in sorted(md.entry_points(group=GROUP), key=lambda e: e.name):
        by_name.setdefault(ep.name, ep)  # the same dist visible twice on sys.path: the first wins
    return list(by_name.values())


def _register(pm: MilesPluginManager, module: Any, name: str, origin: str) -> None:
    if pm.get_plugin(name) is not None or pm.is_registered(module):
        return
    try:
        pm.register(module, name=name)
    except Exception as e:
        raise PluginError(f"plugin {origin} cannot be registered: {e}") from e
    pm.origins[name] = origin


def load_module(spec: str) -> tuple[Any, str]:
    """Import a launch-time plugin from a dotted module name or a ``.py`` path."""
    if spec.endswith(".py") or os.sep in spec or "/" in spec:
        path = Path(spec).expanduser().resolve()
        if not path.is_file():
            raise PluginError(f"plugin file {spec} does not exist; pass a path to a .py file or a "
                              f"dotted module name")
        mod_name = f"miles_launch_{path.stem}"
        loader_spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(loader_spec)
        try:
            sys.modules[mod_name] = module
            loader_spec.loader.exec_module(module)
        except Exception as e:
            sys.modules.pop(mod_name, None)
            raise PluginError(f"plugin file {path} failed to import: {type(e).__name__}: {e}") from e
        return module, str(path)
    try:
        return importlib.import_module(spec), spec
    except Exception as e:
        raise PluginError(f"plugin module {spec!r} failed to import: {type(e).__name__}: {e}") from e


def plugin_table(pm: MilesPluginManager) -> list[dict[str, Any]]:
    """One row per registered plugin: name, distribution, version, hooks it implements."""
    by_plugin: dict[str, list[str]] = {}
    for hook_name in sorted(n for n in dir(pm.hook) if n.startswith("miles_")):
        for impl in getattr(pm.hook, hook_name).get_hookimpls():
            by_plugin.setdefault(pm.get_name(impl.plugin), []).append(hook_name)
    rows, dists = [], md.packages_distributions()  # a scan of site-packages: once, not per row
    for name, plugin in pm.list_name_plugin():
        dist = dists.get((getattr(plugin, "__name__", "") or "").split(".")[0])
        dist_name = dist[0] if dist else ("miles" if name == "miles.builtin" else None)
        version = None
        with contextlib.suppress(md.PackageNotFoundError):
            version = md.version(dist_name) if dist_name else None
        rows.append({"name": name, "distribution": dist_name, "version": version, "origin": pm.origins.get(name, name),
                     "hooks": by_plugin.get(name, [])})
    return rows


def _results(pm: MilesPluginManager, hook_name: str, skip: tuple = (), **kwargs: Any) -> Iterator[Any]:
    """Non-None results of a hook's implementations not in ``skip``, lazily, in pluggy's call order."""
    for impl in reversed(getattr(pm.hook, hook_name).get_hookimpls()):
        if impl.plugin not in skip:
            result = call_hook(impl, pm.describe(impl.plugin), hook_name, **kwargs)
            if result is not None:
                yield result


def call_first(pm: MilesPluginManager, hook_name: str, skip: tuple = (), **kwargs: Any) -> Any:
    """firstresult dispatch: the first non-None result (later implementations are not called)."""
    return next(_results(pm, hook_name, skip, **kwargs), None)


def call_all(pm: MilesPluginManager, hook_name: str, **kwargs: Any) -> list[Any]:
    """Call every implementation; the non-None results."""
    return list(_results(pm, hook_name, **kwargs))
