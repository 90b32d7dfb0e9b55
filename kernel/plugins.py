"""Plugin manager: entry-point discovery, launch-time modules, and component registries."""
from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import importlib.metadata as md
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pluggy

from . import hookspecs
from .errors import MilesError, PluginError

GROUP = "miles.plugins"
KINDS = ("engines", "trainers", "transports", "algorithms", "envs", "model_specs", "launchers", "loggers", "modes",
         "rollouts", "architectures")
# config section -> registry kind, for sections that select a component by ``name``
SECTION_KINDS = {"model": "model_specs", "env": "envs", "engine": "engines", "algorithm": "algorithms",
                 "trainer": "trainers", "transport": "transports", "launcher": "launchers"}
# older spellings of a section, read as the section they name (with a one-line notice)
SECTION_ALIASES = {"sync": "transport"}


def canonical(name: Any) -> Any:
    """Component names use one separator, ``-`` (``tool-use``); ``tool_use`` names the same one."""
    return name.replace("_", "-") if isinstance(name, str) else name


# kinds whose names are someone else's identifiers, kept as given (Hugging Face model_type values)
VERBATIM = ("architectures",)


class Registry(dict):
    """Components of one kind by canonical name; looked up under either separator (unless the
    kind's names are kept verbatim)."""

    def __init__(self, verbatim: bool = False) -> None:
        super().__init__()
        self.key = (lambda name: name) if verbatim else canonical

    def __getitem__(self, name: str) -> "Component":
        return super().__getitem__(self.key(name))

    def __contains__(self, name: object) -> bool:
        return super().__contains__(self.key(name))

    def get(self, name: str, default: Any = None) -> Any:
        return super().get(self.key(name), default)


@dataclass
class Component:
    name: str
    factory: Callable[..., Any]
    config: Any  # pydantic model class or None
    plugin: str  # who registered it


class MilesPluginManager(pluggy.PluginManager):
    """A pluggy manager that also remembers where each plugin came from. Hooks are dispatched by
    pluggy itself (``pm.hook.miles_*``); an exception raised inside a plain hook implementation
    is re-raised as a ``PluginError`` naming the plugin and the hook."""

    def __init__(self) -> None:
        super().__init__("miles")
        self.add_hookspecs(hookspecs)
        self.origins: dict[str, str] = {}  # plugin name -> "dist miles-plugin-x 0.1" or file path
        self._registries: dict[str, dict[str, Component]] | None = None

    def register(self, plugin: object, name: str | None = None) -> str | None:
        registered = super().register(plugin, name)
        for caller in self.get_hookcallers(plugin) or ():
            for impl in caller.get_hookimpls():
                if impl.plugin is plugin and not (impl.wrapper or impl.hookwrapper):
                    impl.function = _naming_errors(impl.function, self, plugin, caller.name)
        return registered

    def describe(self, plugin: object) -> str:
        name = self.get_name(plugin) or repr(plugin)
        return self.origins.get(name, name)

    def registry(self, kind: str) -> dict[str, Component]:
        """Components of ``kind`` (e.g. ``"engines"``), collected from the registration hooks."""
        if self._registries is None:
            self._registries = {k: self._collect(k) for k in KINDS}
        return self._registries[kind]

    def _collect(self, kind: str) -> Registry:
        found = Registry(verbatim=kind in VERBATIM)

        def register(name: str, factory: Callable[..., Any], config: Any = None) -> None:
            who, name = _CALLING.get(), found.key(name)
            if not callable(factory):
                raise PluginError(f"plugin {who} registers {kind[:-1]} {name!r} with a factory that is not "
                                  f"callable ({type(factory).__name__} {factory!r:.40}); register a class or function")
            if name in found:
                raise PluginError(f"{kind[:-1]} {name!r} is registered twice: by {found[name].plugin} "
                                  f"and by {who}; uninstall or disable one of them")
            dict.__setitem__(found, name, Component(name, factory, config, who))

        getattr(self.hook, f"miles_register_{kind}")(register=register)
        return found

    def create(self, kind: str, name: str, cfg: Any, **context: Any) -> Any:
        comp = self.registry(kind)[name]
        try:
            return comp.factory(cfg, **context)
        except ImportError as e:
            raise PluginError(f"{kind[:-1]} {name!r} from {comp.plugin} needs a package that is not "
                              f"installed: {e}. Install it (pip install {e.name or '...'})") from e
        except MilesError:
            raise
        except Exception as e:  # the user learns which plugin failed and why, not a traceback into it
            raise PluginError(f"{kind[:-1]} {name!r} from {comp.plugin} failed to start: "
                              f"{type(e).__name__}: {e}") from e

    def architecture(self, model_type: str | None) -> Any:
        """The ``Architecture`` a plugin registers for a Hugging Face ``model_type`` (None: none)."""
        if model_type is None or model_type not in self.registry("architectures"):
            return None
        return self.create("architectures", model_type, None)


_CALLING: contextvars.ContextVar[str] = contextvars.ContextVar("miles_calling_plugin", default="?")


def _naming_errors(fn: Callable[..., Any], pm: MilesPluginManager, plugin: object,
                   hook_name: str) -> Callable[..., Any]:
    """``fn`` as pluggy calls it (same positional arguments), but an exception names the plugin,
    and registration hooks learn which plugin is registering."""

    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        who = pm.describe(plugin)
        token = _CALLING.set(who)
        try:
            return fn(*args)
        except PluginError:
            raise
        except Exception as e:
            raise PluginError(f"plugin {who} failed in {hook_name}: {type(e).__name__}: {e}") from e
        finally:
            _CALLING.reset(token)
    return call


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
            except (Exception, SystemExit) as e:  # a plugin's sys.exit() must not end miles silently
                raise PluginError(f"plugin {ep.name!r} from distribution {origin} failed to import: "
                                  f"{type(e).__name__}: {e}. Reinstall it, or set "
                                  f"MILES_PLUGINS to an allow-list that leaves it out") from e
            _register(pm, module, ep.name, f"{ep.name} ({origin})")
        _check_allow(allow)
    for spec in extra:
        module, origin = load_module(spec)
        _register(pm, module, origin, origin)
    return pm


def _check_allow(allow: list[str] | None) -> None:
    """An allow-list name that no installed plugin has (a typo) hides plugins: say so up front."""
    eps = _entry_points()
    known = {ep.name for ep in eps} | {ep.dist.name for ep in eps if ep.dist}
    unknown = [a for a in allow or () if a not in known]
    if unknown:
        raise PluginError(f"MILES_PLUGINS names {', '.join(unknown)}, which no installed plugin is "
                          f"(installed: {', '.join(sorted(ep.name for ep in eps)) or 'none'}); fix the "
                          f"names (entry-point or distribution names) or unset MILES_PLUGINS")


def _entry_points() -> list[Any]:
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
            what = "is a folder" if path.is_dir() else "is not a regular file" if path.exists() else "does not exist"
            raise PluginError(f"plugin file {spec} {what}; pass a path to a .py file or a dotted module name")
        mod_name = f"miles_launch_{path.stem}"
        loader_spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(loader_spec)
        try:
            sys.modules[mod_name] = module
            loader_spec.loader.exec_module(module)
        except (Exception, SystemExit) as e:
            sys.modules.pop(mod_name, None)
            raise PluginError(f"plugin file {path} failed to import: {type(e).__name__}: {e}") from e
        return module, str(path)
    try:
        return importlib.import_module(spec), spec
    except (Exception, SystemExit) as e:
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
