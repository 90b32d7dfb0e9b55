"""Config: one YAML file plus ``key.sub=value`` overrides, validated all at once.

Kernel sections (``run``, ``rollout``) have schemas here; a section that selects a component
(``model``, ``env``, ``engine``, ``algorithm``, ``trainer``, ``transport``, ``launcher``) names it with
``name`` and the rest of the section is validated by that component's own schema.
"""
from __future__ import annotations

import enum
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .configfile import MAX_BYTES, YAMLLimitError, load_text
from .errors import ConfigError
from .plugins import SECTION_ALIASES, SECTION_KINDS, MilesPluginManager, canonical


# --- the config as data: one YAML file plus key.sub=value overrides, and raw sections checked
# against pydantic schemas, every problem a string that starts with its dotted key, collected
# rather than raised so that a caller reports all of them at once

def read_yaml(path: str) -> dict[str, Any]:
    """The file's top-level mapping; a missing file, invalid YAML or another top level is a
    ``ConfigError`` naming the file."""
    p = Path(path)
    if not p.is_file():
        what = "is a folder" if p.is_dir() else "is not a regular file" if p.exists() else "does not exist"
        raise ConfigError([f"file {path} {what}; pass a YAML config file"], source=str(path))
    try:
        if p.stat().st_size > MAX_BYTES:
            raise YAMLLimitError(f"is {p.stat().st_size >> 20} MiB; a config file holds at most "
                                 f"{MAX_BYTES >> 20} MiB")
        data = load_text(p.read_text()) or {}
    except YAMLLimitError as e:
        raise ConfigError([str(e)], source=str(path)) from None
    except yaml.YAMLError as e:
        raise ConfigError([f"not valid YAML: {e}"], source=str(path)) from None
    except OSError as e:
        raise ConfigError([f"cannot be read: {e.strerror}"], source=str(path)) from None
    if not isinstance(data, dict):
        raise ConfigError(["the top level must be a mapping of sections"], source=str(path))
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``a.b=value`` (value parsed as YAML, so numbers/bools/lists work). An aliased section
    (``sync``) is read as the section it names, in the file and in the overrides alike, so an
    override under either spelling wins over the file's value."""
    problems: list[str] = []
    unaliased = _unalias(data, problems)
    data.clear()
    data.update(unaliased)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            problems.append(f"override {item!r} must look like key.sub=value")
            continue
        node, parts = data, key.split(".")
        if parts[0] in SECTION_ALIASES:
            _notice(parts[0])
            parts[0] = SECTION_ALIASES[parts[0]]
        for i, part in enumerate(parts[:-1]):
            if not isinstance(node.setdefault(part, {}), dict):
                where = ".".join(parts[:i + 1])
                problems.append(f"{key}: {where} is {node[part]!r}, not a mapping, so it has no key "
                                f"{parts[i + 1]!r}; drop one of the two settings")
                break
            node = node[part]
        else:
            try:
                node[parts[-1]] = _scalar(value)
            except YAMLLimitError as e:
                problems.append(f"{key}: the value {e}")
    if problems:
        raise ConfigError(problems, source="command line")
    return data


def _scalar(text: str) -> Any:
    """An override value parsed as YAML (``ConfigLoader``: 2e-3 is a float); text that is no YAML
    stays text."""
    try:
        return load_text(text)
    except YAMLLimitError:
        raise
    except yaml.YAMLError:
        return text


def validate_settings(model: type[BaseModel] | None, prefix: str, raw: dict, problems: list[str]) -> Any:
    """``raw`` validated by ``model`` (``None``: a component without settings), or ``None`` with
    the problems, each named ``prefix.<key>``, appended to ``problems``."""
    if model is None:
        if raw:
            problems.append(f"{prefix}: takes no settings; unknown keys: {', '.join(raw)}")
        return None
    try:  # strict: true is no 1, "3" no 3; JSON mode still reads lists as tuples, text as paths/enums
        return model.model_validate_json(json.dumps(raw, default=_jsonable, allow_nan=True), strict=True)
    except ValidationError as e:
        problems.extend(pydantic_problems(prefix, e, model))
        return None


def _jsonable(value: Any) -> Any:
    """JSON for the values YAML or a dumped schema may hold besides JSON's own (dates, sets,
    enums, paths, nested schemas)."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def section_mapping(data: dict[str, Any], section: str, problems: list[str]) -> dict[str, Any]:
    """A copy of ``data[section]`` (absent: empty); a section that is not a mapping is a problem."""
    raw = data.get(section) or {}
    if not isinstance(raw, dict):
        problems.append(f"{section}: must be a mapping of keys to values (got {raw!r})")
        return {}
    return dict(raw)


def pydantic_problems(prefix: str, err: ValidationError, model: type[BaseModel] | None) -> list[str]:
    """One line per error of ``err``: its dotted key, then pydantic's message and the value given;
    an unknown key lists the keys allowed at that level."""
    out = []
    for e in err.errors():
        loc = ".".join(str(x) for x in (prefix, *e["loc"]) if x != "")
        if e["type"] == "extra_forbidden":
            allowed = ", ".join(sorted(_fields_at(model, e["loc"][:-1])))
            out.append(f"{loc}: unknown key; allowed keys: {allowed}")
        else:
            got = e.get("input")
            got = "" if isinstance(got, dict) else f" (got {got!r})"
            out.append(f"{loc}: {e['msg']}{got}")
    return out


def _fields_at(model: Any, loc: tuple) -> list[str]:
    """The field names of the (nested) schema at ``loc``, through optional/union annotations."""
    for part in loc:
        info = getattr(model, "model_fields", {}).get(part)
        ann = getattr(info, "annotation", None)
        model = next((a for a in getattr(ann, "__args__", (ann,)) if hasattr(a, "model_fields")), None)
    return list(getattr(model, "model_fields", {}) or ["name"])


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class TelemetryConfig(Strict):
    """``run.telemetry``: what a run records in ``RUN/telemetry`` for ``miles dashboard``."""

    enabled: bool = Field(True, description="record span timings, sampled trajectories and device "
                          "readings (false: none of them)")
    samples: int = Field(4, ge=0, description="trajectories kept per step, with per-token rollout and "
                         "training log-probs (0: none)")
    max_mb: float = Field(64.0, gt=0, description="size cap of the rotating sample and device files")
    devices_every: float = Field(5.0, ge=0, description="seconds between device and engine readings "
                                 "(0: none)")


class RunConfig(Strict):
    steps: int = Field(100, ge=0, description="training steps of the run")
    out_dir: str = Field("runs/default", description="run folder: metrics.jsonl, checkpoints, config")
    seed: int = Field(0, ge=0, lt=2**32, description="seed for data order, sampling and initialisation "
                      "(0 to 2**32-1, the range every library's generator takes)")
    checkpoint_every: int = Field(20, gt=0, description="steps between checkpoints (the last step always)")
    keep_checkpoints: int = Field(2, gt=0, description="newest checkpoints kept on disk")
    eval_every: int = Field(10, gt=0, description="steps between evaluations (step 0 and the last always)")
    threads: int | None = Field(None, gt=0, description="torch CPU threads (default: torch's choice)")
    warm_start: dict[str, Any] | None = Field(None, description="optional supervised warm start before RL; "
                                              "its keys are the schema of the plugin that runs it (miles-plugin-sft)")
    max_nonfinite_steps: int = Field(3, gt=0, description="consecutive steps with a NaN/inf loss "
                                     "(each skipped by the trainer) that end the run")
    mode: str = Field("sync", description="a registered run mode. sync: rollout then train, exactly "
                      "on-policy; async (miles-plugin-async): rollout workers stream groups into a "
                      "bounded buffer while the trainer trains")
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig, description="what the run "
                                       "records for miles dashboard")


class RolloutConfig(Strict):
    """The kernel's rollout keys. The ``rollout`` section also holds the settings of the selected
    rollout component (``name``) and of the run mode (``run.mode``), each validated by its own
    schema."""

    name: str = Field("single-turn", description="a registered rollout component: single-turn "
                      "(one generation per sample) or a plugin's (e.g. multi-turn)")
    batch_size: int = Field(64, gt=0, description="prompts per training step")
    n: int = Field(4, gt=0, description="samples per prompt (group size)")
    temperature: float = Field(1.0, ge=0, description="sampling temperature (0 = greedy)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling threshold")
    top_k: int = Field(0, ge=0, description="top-k sampling (0 = off)")
    max_new_tokens: int = Field(16, gt=0, description="response length limit")
    oversample_rounds: int = Field(0, ge=0, description="extra rollout rounds to refill a batch "
                                   "whose groups were filtered out (bounded, never a hang)")
    minibatches: int = Field(1, gt=0, description="optimizer steps per rollout batch (PPO-style "
                             "mini-batches; >1 recomputes old log-probs)")
    reward_budget: float = Field(10.0, gt=0, description="seconds one sample's reward may take (a "
                                 "miles_reward plugin or the env's verifier); slower calls are counted "
                                 "(metric rewards_over_budget) and their source named once")
    eval_max_new_tokens: int | None = Field(None, gt=0, description="limit for greedy evaluation "
                                            "(default: max_new_tokens)")
    true_on_policy: bool = Field(False, description="the engine re-scores each training mini-batch "
                                 "with the trainer's own log-prob routine on its copy of the weights, "
                                 "so rollout and training log-probs are bitwise equal (ratio exactly "
                                 "1, train_rollout_logprob_abs_diff 0); sync mode, one trainer rank")


DEFAULT_NAMES = {"model": "hf", "env": "arith", "engine": "torch", "algorithm": "grpo",
                 "trainer": "fsdp2", "transport": "tensor", "launcher": None}
# draft: online training of a speculative-decoding draft, validated by the trainer plugin that runs it
TOP_LEVEL = ["run", "rollout", *SECTION_KINDS, "draft", "loggers", "plugins"]
# components that in-repo plugin distributions provide, for "not installed" errors
PROVIDERS = {("modes", "async"): "miles-plugin-async", ("launchers", "local"): "miles-plugin-local",
             ("loggers", "console"): "miles-plugin-console", ("algorithms", "sft"): "miles-plugin-sft"}


@dataclass
class Config:
    run: RunConfig
    rollout: RolloutConfig
    components: dict[str, tuple[str | None, Any]]  # section -> (name, validated settings)
    rollout_settings: Any  # the rollout component's own settings (its schema), or None
    mode_settings: Any  # the run mode's own settings (its schema), or None
    loggers: list[tuple[str, Any]]
    plugins: list[str]
    raw: dict[str, Any] = field(default_factory=dict)

    def name(self, section: str) -> str | None:
        return self.components[section][0]

    def settings(self, section: str) -> Any:
        return self.components[section][1]

    def resolved(self) -> dict[str, Any]:
        """The config as validated, defaults included (what a run folder's config.yaml holds)."""
        def dump(name: str | None, *settings: Any) -> dict[str, Any]:
            out = {"name": name} if name else {}
            for s in settings:
                out.update(s.model_dump(mode="json") if isinstance(s, BaseModel) else {})
            return out
        sections = {s: dump(n, v) for s, (n, v) in self.components.items() if n is not None}
        return {"run": self.run.model_dump(mode="json"),
                "rollout": dump(None, self.rollout, self.rollout_settings, self.mode_settings), **sections,
                **({"draft": self.raw["draft"]} if self.raw.get("draft") is not None else {}),
                "loggers": [dump(n, v) for n, v in self.loggers], "plugins": list(self.plugins)}


def validate_section(pm: MilesPluginManager, section: str, raw: Any, problems: list[str]) -> tuple[str | None, Any]:
    """(name, settings) for a component section; problems appended, never raised."""
    kind = SECTION_KINDS[section]
    raw = dict(raw) if isinstance(raw, dict) else ({} if raw is None else raw)
    if not isinstance(raw, dict):
        problems.append(f"{section}: must be a mapping with a 'name' key")
        return None, None
    name = canonical(raw.pop("name", DEFAULT_NAMES[section]))
    if name is None:
        if raw:
            problems.append(f"{section}: settings given but no {section}.name")
        return None, None
    if not registered(pm, kind, f"{section}.name", name, problems):
        return name, None
    return name, validate_settings(pm.registry(kind)[name].config, section, raw, problems)


def validate_nested(pm: MilesPluginManager, kind: str, prefix: str, raw: Any, default: str,
                    wrapper: str) -> tuple[str, Any]:
    """A component section inside another's settings (``model.base`` of a spec that wraps another,
    like ``lora``): its name and validated settings from the run's registry (launch-time plugins
    included); a ``ConfigError`` lists every problem, each naming ``prefix.<key>``."""
    raw, problems, settings = dict(raw or {}), [], None
    name = canonical(raw.pop("name", default))
    if name == wrapper:
        problems.append(f"{prefix}.name: {wrapper} cannot wrap itself; name the {kind[:-1].replace('_', ' ')} "
                        f"it wraps (e.g. {default})")
    elif registered(pm, kind, f"{prefix}.name", name, problems):
        settings = validate_settings(pm.registry(kind)[name].config, prefix, raw, problems)
    if problems:
        raise ConfigError(problems, source=prefix)
    return name, settings


def registered(pm: MilesPluginManager, kind: str, key: str, name: Any, problems: list[str]) -> bool:
    """Whether ``name`` is a registered component of ``kind``; if not, a problem naming ``key``."""
    registry = pm.registry(kind)
    if name in registry:
        return True
    known = ", ".join(sorted(registry)) or "none installed"
    dist = PROVIDERS.get((kind, name))
    fix = f"pip install {dist}, which provides it" if dist else "install or --plugin the plugin that provides it"
    if os.environ.get("MILES_PLUGINS"):  # an allow-list leaves installed plugins out
        fix += f"; MILES_PLUGINS={os.environ['MILES_PLUGINS']} loads only those installed plugins"
    problems.append(f"{key}: unknown {kind[:-1].replace('_', ' ')} {name!r}; registered: {known} ({fix})")
    return False


_NOTICED: set[str] = set()


def _notice(old: str) -> None:
    if old not in _NOTICED:
        _NOTICED.add(old)
        new = SECTION_ALIASES[old]
        print(f"note: the {old}: section is now spelled {new}: (read as {new}:)", file=sys.stderr)


def _unalias(data: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """``data`` with each aliased section (``sync:``) read as the section it names (``transport:``);
    keys given under both spellings must agree. Says once per process that the old one is read."""
    data = dict(data)
    for old, new in SECTION_ALIASES.items():
        if old not in data:
            continue
        _notice(old)
        raw, given = data.pop(old), data.get(new)
        if given is None:
            data[new] = raw
        elif isinstance(raw, dict) and isinstance(given, dict):
            clash = [k for k in raw if k in given and raw[k] != given[k]]
            problems += [f"{old}.{k}: differs from {new}.{k}; set it once, under {new}:" for k in clash]
            data[new] = {**given, **raw}
        else:
            problems.append(f"{old}: given beside {new}:; keep only {new}:")
    return data


def resolve(pm: MilesPluginManager, data: dict[str, Any], source: str = "config") -> Config:
    """Validate everything; raise one ConfigError listing every problem."""
    problems: list[str] = []
    data = _unalias(data, problems)
    problems += [f"{key}: unknown section; allowed: {', '.join(TOP_LEVEL)}" for key in data if key not in TOP_LEVEL]
    run = validate_settings(RunConfig, "run", section_mapping(data, "run", problems), problems)
    rollout, rollout_settings, mode_settings = _rollout_section(pm, data, run, problems)
    components = {s: validate_section(pm, s, data.get(s), problems) for s in SECTION_KINDS}
    _default_launcher(pm, data, components, problems)
    _ranks_agree(data, components, problems)
    if rollout is not None:
        problems += _memory_problems(rollout)
    if run is not None and rollout is not None and rollout.true_on_policy and run.mode != "sync":
        problems.append("rollout.true_on_policy: needs run.mode sync (async rollouts come from older weights)")
    if run is not None and run.warm_start is not None:  # its keys: the plugin that runs it checks them
        if not pm.hook.miles_warm_start.get_hookimpls():
            problems.append("run.warm_start: no installed plugin runs a warm start (miles_warm_start); "
                            "pip install miles-plugin-sft, which does, or remove run.warm_start")
        else:
            problems += pm.hook.miles_validate_warm_start(settings=run.warm_start, pm=pm) or []
    loggers = []
    raw_loggers = data.get("loggers", [n for n in ("console",) if n in pm.registry("loggers")]) or []
    if not isinstance(raw_loggers, list):
        problems.append("loggers: must be a list of logger names or {name: ...} mappings")
        raw_loggers = []
    for i, item in enumerate(raw_loggers):
        entry = {"name": item} if isinstance(item, str) else dict(item or {})
        name = entry.pop("name", None)
        if registered(pm, "loggers", f"loggers[{i}]", name, problems):
            settings = pm.registry("loggers")[name].config
            loggers.append((name, validate_settings(settings, f"loggers[{i}]", entry, problems)))
    plugins = data.get("plugins") or []
    if not isinstance(plugins, list) or not all(isinstance(p, str) for p in plugins):
        problems.append("plugins: must be a list of module names or .py paths")
    if problems:
        raise ConfigError(problems, source=source)
    cfg = Config(run, rollout, components, rollout_settings, mode_settings, loggers, plugins, data)
    problems = _plugin_problems(pm, cfg)
    if problems:
        raise ConfigError(problems, source=source)
    return cfg


SAMPLE_BYTES, TOKEN_BYTES = 1024, 64  # a Sample's fields, and per token its id, log-prob and mask


def _memory_problems(rollout: RolloutConfig) -> list[str]:
    """A step's samples must fit in the host's available memory: a lower bound (the Python objects
    alone, before any engine cache), so a typo such as rollout.n=1000000000 is refused up front
    instead of dying in an allocation."""
    samples = rollout.batch_size * rollout.n
    need = samples * (SAMPLE_BYTES + TOKEN_BYTES * rollout.max_new_tokens)
    free = available_memory()
    if free is None or need <= free:
        return []
    return [f"rollout: batch_size {rollout.batch_size} x n {rollout.n} = {samples:,} samples a step of up to "
            f"{rollout.max_new_tokens} tokens need at least {need / 2**30:,.1f} GiB of memory; this host has "
            f"{free / 2**30:,.1f} GiB available: lower rollout.batch_size, rollout.n or rollout.max_new_tokens"]


def available_memory() -> int | None:
    """Bytes of memory available to new allocations (Linux ``MemAvailable``), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _plugin_problems(pm: MilesPluginManager, cfg: Config) -> list[str]:
    """The problems ``miles_validate_config`` implementations find: each returns a list of strings
    (one string is one problem); any other answer is itself a problem naming the plugin."""
    problems: list[str] = []
    hook = pm.hook.miles_validate_config
    for answer in hook(config=cfg, pm=pm):
        if isinstance(answer, str):
            problems.append(answer)
        elif isinstance(answer, (list, tuple)) and all(isinstance(p, str) for p in answer):
            problems += answer
        else:  # which plugin said it: asked one by one, on this rare path only
            impls = [i for i in hook.get_hookimpls() if not (i.wrapper or i.hookwrapper)]
            args = {"config": cfg, "pm": pm}
            who = [pm.describe(i.plugin) for i in impls if i.function(*[args[a] for a in i.argnames]) == answer]
            problems.append(f"plugins: miles_validate_config of plugin {', '.join(who) or '?'} returned "
                            f"{type(answer).__name__} {answer!r:.60}; it must return a list of problem "
                            f"strings (or None: no problems)")
    return problems


def _ranks_agree(data: dict[str, Any], components: dict[str, Any], problems: list[str]) -> None:
    """``trainer.world_size`` and a launcher's ``trainer_ranks`` count the same processes: two
    different numbers are refused here, not by a trainer rank after the launch files are written."""
    trainer = data.get("trainer") if isinstance(data.get("trainer"), dict) else {}
    ranks = getattr(components["launcher"][1], "trainer_ranks", None)
    size = trainer.get("world_size")
    if isinstance(size, int) and isinstance(ranks, int) and size != ranks:
        problems.append(f"trainer.world_size: {size}, but launcher.trainer_ranks starts {ranks} rank(s); set "
                        f"one of them (trainer.world_size: null follows the launcher)")


def _default_launcher(pm: MilesPluginManager, data: dict[str, Any], components: dict[str, Any],
                      problems: list[str]) -> None:
    """No launcher and ``trainer.world_size: N > 1``: the ``local`` launcher with N trainer ranks
    (the engine stays inside rank 0), so one command runs a multi-rank trainer."""
    trainer = data.get("trainer") if isinstance(data.get("trainer"), dict) else {}
    ranks = trainer.get("world_size")
    if components["launcher"][0] is not None or not isinstance(ranks, int) or ranks < 2:
        return
    if registered(pm, "launchers", "trainer.world_size (its local launcher)", "local", problems):
        settings = validate_settings(pm.registry("launchers")["local"].config, "launcher",
                                     {"trainer_ranks": ranks, "engines": 0}, problems)
        components["launcher"] = ("local", settings)


def _owner_hint(pm: MilesPluginManager, key: str) -> str:
    """Which other run mode or rollout component has ``key`` among its settings, if any."""
    for kind, selector in (("modes", "run.mode"), ("rollouts", "rollout.name")):
        for name, comp in pm.registry(kind).items():
            if key in getattr(comp.config, "model_fields", {}):
                return f" ({key} is a setting of {selector} {name}: set {selector}: {name})"
    return ""


def _rollout_section(pm: MilesPluginManager, data: dict[str, Any], run: RunConfig | None,
                     problems: list[str]) -> tuple[RolloutConfig | None, Any, Any]:
    """The ``rollout`` section split three ways: the kernel's keys, the rollout component's
    (``rollout.name``) and the run mode's (``run.mode``); a key none of them knows is a problem
    listing what all three allow."""
    raw = section_mapping(data, "rollout", problems)
    name = canonical(raw.get("name", "single-turn"))
    if "name" in raw:
        raw["name"] = name
    parts: dict[str, tuple[Any, dict[str, Any]]] = {"kernel": (RolloutConfig, {})}
    if registered(pm, "rollouts", "rollout.name", name, problems):
        parts["component"] = (pm.registry("rollouts")[name].config, {})
    if run is not None and registered(pm, "modes", "run.mode", run.mode, problems):
        parts["mode"] = (pm.registry("modes")[run.mode].config, {})
    allowed = sorted({k for model, _ in parts.values() for k in getattr(model, "model_fields", {})})
    for key, value in raw.items():
        owner = next((p for p, (model, _) in parts.items() if key in getattr(model, "model_fields", {})), None)
        if owner is None:
            problems.append(f"rollout.{key}: unknown key; allowed keys: {', '.join(allowed)}{_owner_hint(pm, key)}")
        else:
            parts[owner][1][key] = value
    out = [validate_settings(model, "rollout", values, problems) if model is not None or values else None
           for model, values in (parts.get(p, (None, {})) for p in ("kernel", "component", "mode"))]
    return out[0], out[1], out[2]
