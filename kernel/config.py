"""Config: one YAML file plus ``key.sub=value`` overrides, validated all at once.

Kernel sections (``run``, ``rollout``) have schemas here; a section that selects a component
(``model``, ``env``, ``engine``, ``algorithm``, ``trainer``, ``sync``, ``launcher``) names it with
``name`` and the rest of the section is validated by that component's own schema.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import ConfigError
from .plugins import SECTION_KINDS, MilesPluginManager


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WarmStartConfig(Strict):
    """Supervised warm start on ``env.demonstrations()`` before RL, run to convergence: it stops
    when eval accuracy has not improved by ``min_delta`` for ``patience`` evaluations."""

    max_steps: int = Field(2000, gt=0, description="upper bound on supervised steps")
    min_steps: int = Field(0, ge=0, description="no early stop before this many steps")
    batch_size: int = Field(256, gt=0, description="demonstrations per step")
    eval_every: int = Field(50, gt=0, description="supervised steps between evaluations")
    patience: int = Field(4, gt=0, description="evaluations without improvement before stopping")
    min_delta: float = Field(0.005, ge=0, description="improvement that resets patience")
    algorithm: str = Field("sft", description="registered algorithm used for the warm start")
    trainer: dict[str, Any] = Field(default_factory=dict,
                                    description="trainer settings overridden during the warm start")


class RunConfig(Strict):
    steps: int = Field(100, ge=0, description="training steps of the run")
    out_dir: str = Field("runs/default", description="run folder: metrics.jsonl, checkpoints, config")
    seed: int = Field(0, description="seed for data order, sampling and initialisation")
    checkpoint_every: int = Field(20, gt=0, description="steps between checkpoints (the last step always)")
    keep_checkpoints: int = Field(2, gt=0, description="newest checkpoints kept on disk")
    eval_every: int = Field(10, gt=0, description="steps between evaluations (step 0 and the last always)")
    threads: int | None = Field(None, gt=0, description="torch CPU threads (default: torch's choice)")
    warm_start: WarmStartConfig | None = Field(None, description="optional supervised warm start")
    max_nonfinite_steps: int = Field(3, gt=0, description="consecutive steps with a NaN/inf loss "
                                     "(each skipped by the trainer) that end the run")
    mode: str = Field("sync", description="a registered run mode. sync: rollout then train, exactly "
                      "on-policy; async (miles-plugin-async): rollout workers stream groups into a "
                      "bounded buffer while the trainer trains")


class RolloutConfig(Strict):
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
    max_staleness: int = Field(1, ge=0, description="async: rollout workers generate no group "
                               "that would be more than this many weight versions old when trained "
                               "on; groups that still are get stale_policy")
    stale_policy: Literal["drop", "importance"] = Field("drop", description="async: groups older "
                                                        "than max_staleness are dropped, or kept "
                                                        "(importance-weighted like any stale sample)")
    correct_stale: bool = Field(True, description="async: samples from older weights than the "
                                "trainer's are trained with truncated importance weights "
                                "min(pi/pi_rollout, importance_cap) per token (decoupled PPO); "
                                "false: as if they were on-policy")
    importance_cap: float = Field(2.0, gt=0, description="async: truncation of importance weights")
    buffer_groups: int | None = Field(None, gt=0, description="async: buffer capacity in groups "
                                      "(default 2 x batch_size)")
    async_workers: int = Field(2, gt=0, description="async: rollout threads, each keeping one request "
                               "of up to batch_size prompts in flight (pacing sizes it)")
    in_flight: Literal["finish", "resume"] = Field(
        "finish", description="async: requests in flight when new weights are pushed. finish: they "
        "end on the old weights; resume (partial rollout; engines in their own processes): they are "
        "aborted and continue from their tokens so far on the new weights (Sample.weight_versions)")
    eval_max_new_tokens: int | None = Field(None, gt=0, description="limit for greedy evaluation "
                                            "(default: max_new_tokens)")
    true_on_policy: bool = Field(False, description="the engine re-scores each training mini-batch "
                                 "with the trainer's own log-prob routine on its copy of the weights, "
                                 "so rollout and training log-probs are bitwise equal (ratio exactly "
                                 "1, train_rollout_logprob_abs_diff 0); sync mode, one trainer rank")


KERNEL_SECTIONS: dict[str, type[BaseModel]] = {"run": RunConfig, "rollout": RolloutConfig}
DEFAULT_NAMES = {"model": "hf", "env": "arith", "engine": "torch", "algorithm": "grpo",
                 "trainer": "fsdp2", "sync": "tensor", "launcher": None}
TOP_LEVEL = [*KERNEL_SECTIONS, *SECTION_KINDS, "loggers", "plugins"]
# components that in-repo plugin distributions provide, for "not installed" errors
PROVIDERS = {("modes", "async"): "miles-plugin-async"}


@dataclass
class Config:
    run: RunConfig
    rollout: RolloutConfig
    components: dict[str, tuple[str | None, Any]]  # section -> (name, validated settings)
    warm_start_trainer: Any  # trainer settings with run.warm_start.trainer applied
    loggers: list[tuple[str, Any]]
    plugins: list[str]
    raw: dict[str, Any] = field(default_factory=dict)

    def name(self, section: str) -> str | None:
        return self.components[section][0]

    def settings(self, section: str) -> Any:
        return self.components[section][1]


def read_yaml(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError([f"file {path} does not exist"], source=str(path))
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError([f"not valid YAML: {e}"], source=str(path)) from None
    if not isinstance(data, dict):
        raise ConfigError(["the top level must be a mapping of sections"], source=str(path))
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``a.b=value`` (value parsed as YAML, so numbers/bools/lists work)."""
    problems = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            problems.append(f"override {item!r} must look like key.sub=value")
            continue
        node, parts = data, key.split(".")
        for part in parts[:-1]:
            if not isinstance(node.setdefault(part, {}), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = _scalar(value)
    if problems:
        raise ConfigError(problems, source="command line")
    return data


def _scalar(text: str) -> Any:
    """YAML parsing of an override value, plus the floats YAML 1.1 leaves as strings (2e-3)."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    return value


def _pydantic_problems(prefix: str, err: ValidationError, model: type[BaseModel] | None) -> list[str]:
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
    for part in loc:
        info = getattr(model, "model_fields", {}).get(part)
        ann = getattr(info, "annotation", None)
        model = next((a for a in getattr(ann, "__args__", (ann,)) if hasattr(a, "model_fields")), None)
    return list(getattr(model, "model_fields", {}) or ["name"])


def validate_section(pm: MilesPluginManager, section: str, raw: Any, problems: list[str]):
    """(name, settings) for a component section; problems appended, never raised."""
    kind = SECTION_KINDS[section]
    raw = dict(raw) if isinstance(raw, dict) else ({} if raw is None else raw)
    if not isinstance(raw, dict):
        problems.append(f"{section}: must be a mapping with a 'name' key")
        return None, None
    name = raw.pop("name", DEFAULT_NAMES[section])
    if name is None:
        if raw:
            problems.append(f"{section}: settings given but no {section}.name")
        return None, None
    if not registered(pm, kind, f"{section}.name", name, problems):
        return name, None
    return name, validate_settings(pm.registry(kind)[name].config, section, raw, problems)


def registered(pm: MilesPluginManager, kind: str, key: str, name: Any, problems: list[str]) -> bool:
    """Whether ``name`` is a registered component of ``kind``; if not, a problem naming ``key``."""
    registry = pm.registry(kind)
    if name in registry:
        return True
    known = ", ".join(sorted(registry)) or "none installed"
    dist = PROVIDERS.get((kind, name))
    fix = f"pip install {dist}, which provides it" if dist else "install or --plugin the plugin that provides it"
    problems.append(f"{key}: unknown {kind[:-1].replace('_', ' ')} {name!r}; registered: {known} ({fix})")
    return False


def validate_settings(model: type[BaseModel] | None, prefix: str, raw: dict, problems: list[str]):
    if model is None:
        if raw:
            problems.append(f"{prefix}: takes no settings; unknown keys: {', '.join(raw)}")
        return None
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        problems.extend(_pydantic_problems(prefix, e, model))
        return None


def resolve(pm: MilesPluginManager, data: dict[str, Any], source: str = "config") -> Config:
    """Validate everything; raise one ConfigError listing every problem."""
    problems = [f"{key}: unknown section; allowed: {', '.join(TOP_LEVEL)}" for key in data if key not in TOP_LEVEL]
    kernel = {s: validate_settings(model, s, data.get(s) or {}, problems) for s, model in KERNEL_SECTIONS.items()}
    components = {s: validate_section(pm, s, data.get(s), problems) for s in SECTION_KINDS}
    run, rollout, warm_trainer = kernel.get("run"), kernel.get("rollout"), None
    if run is not None:
        registered(pm, "modes", "run.mode", run.mode, problems)
    if run is not None and rollout is not None and rollout.true_on_policy and run.mode != "sync":
        problems.append("rollout.true_on_policy: needs run.mode sync (async rollouts come from older weights)")
    if run is not None and rollout is not None and rollout.in_flight == "resume" and run.mode != "async":
        problems.append("rollout.in_flight: resume needs run.mode async (sync runs never push weights "
                        "while generating)")
    if run is not None and run.warm_start is not None:
        ws = run.warm_start
        registered(pm, "algorithms", "run.warm_start.algorithm", ws.algorithm, problems)
        trainer_name = components["trainer"][0]
        if trainer_name in pm.registry("trainers"):
            merged = {**{k: v for k, v in (data.get("trainer") or {}).items() if k != "name"}, **ws.trainer}
            warm_trainer = validate_settings(pm.registry("trainers")[trainer_name].config,
                                             "run.warm_start.trainer", merged, problems)
    loggers = []
    raw_loggers = data.get("loggers", ["console"]) or []
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
    return Config(kernel["run"], kernel["rollout"], components, warm_trainer, loggers, plugins, data)
