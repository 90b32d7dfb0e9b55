"""A seeded config fuzzer: hundreds of bad configs and overrides through ``miles.cli.main``.

Every case must fail in validation (before any model is built) with exit status 2, one
``miles: error:`` message naming each problem's key once, no Python traceback, and leave an
existing run folder byte-for-byte unchanged. ``MILES_FUZZ_SEED`` picks another seed (default 0);
``MILES_FUZZ_CASES`` the number of cases (default 520). A failure prints the seed and the case.
"""
from __future__ import annotations

import functools
import os
import random
import string
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import annotated_types as at
import miles.plugins
import pytest
import yaml
from miles import MilesError
from miles.cli import main
from miles.config import resolve
from miles.plugins import SECTION_KINDS, make_plugin_manager

ROOT = Path(__file__).resolve().parents[1]
BASE = yaml.safe_load((ROOT / "tests" / "tiny.yaml").read_text())
SEED = int(os.environ.get("MILES_FUZZ_SEED", "0"))
CASES = int(os.environ.get("MILES_FUZZ_CASES", "520"))


@dataclass
class Case:
    kind: str
    overrides: list[str] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)  # one problem line per key (a ConfigError)
    names: list[str] = field(default_factory=list)  # a single-message error must mention these
    config_text: str | None = None  # a config file of its own instead of tests/tiny.yaml
    argv_extra: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    section: str = ""  # top-level section a combinable case touches


def _flat(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 9))) + "_x"


def _bounds(info: Any) -> list[Any]:
    return [m for m in getattr(info, "metadata", []) if isinstance(m, (at.Gt, at.Ge, at.Lt, at.Le))]


def _core(ann: Any) -> tuple[Any, bool]:
    """(the annotation without Optional, whether None is allowed)."""
    args = typing.get_args(ann)
    if typing.get_origin(ann) in (typing.Union, getattr(__import__("types"), "UnionType", None)) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else None), True
    return ann, False


def bad_values(info: Any, rng: random.Random, schema: Any = None) -> list[Any]:
    """Values that the field's annotation or bounds reject (inf/nan where the schema says finite)."""
    ann, _ = _core(info.annotation)
    origin, out = typing.get_origin(ann), []
    finite = getattr(schema, "model_config", {}).get("allow_inf_nan") is False or any(
        getattr(m, "allow_inf_nan", None) is False for m in getattr(info, "metadata", []))
    if ann is bool:
        out = ["maybe", 7, [True]]
    elif ann is int:
        out = ["many", 2.5, [1], {"a": 1}]
    elif ann is float:
        out = ["fast", [0.5], {"a": 1}]
    elif ann is str:
        out = [[1, 2], {"a": 1}, 12]
    elif origin is typing.Literal:
        out = [_word(rng), 3]
    elif origin in (dict,):
        out = ["text", [1, 2], 4]
    elif origin in (list,):
        out = ["text" if typing.get_args(ann)[:1] != (str,) else 5, {"a": 1}]
    elif origin is tuple:
        out = ["text", [0.1] * (len(typing.get_args(ann)) + 1)]
    elif isinstance(ann, type) and hasattr(ann, "model_fields"):
        out = [5, "text"]
    if ann is float and finite:
        out += [float("inf"), float("nan")]
    for b in _bounds(info):  # out of range
        if ann in (int, float):
            if isinstance(b, at.Gt):
                out += [b.gt, b.gt - 1]
            elif isinstance(b, at.Ge):
                out += [b.ge - 1]
            elif isinstance(b, at.Lt):
                out += [b.lt]
            elif isinstance(b, at.Le):
                out += [b.le + 1]
    return out


@functools.lru_cache(maxsize=1)
def _cached_entry_points():
    return _ENTRY_POINTS()


_ENTRY_POINTS = miles.plugins._entry_points


def sections(pm) -> list[tuple[str, str | None, Any, dict]]:
    """(section, component name, schema, base settings) that resolve cleanly on their own."""
    out = []
    for section, kind in SECTION_KINDS.items():
        for name, comp in sorted(pm.registry(kind).items()):
            if comp.config is None:
                continue
            base = {k: v for k, v in (BASE.get(section) or {}).items() if k != "name"} \
                if (BASE.get(section) or {}).get("name") == name else {}
            data = {**BASE, section: {"name": name, **base}}
            if section == "trainer":
                data["run"] = {**BASE["run"], "warm_start": None}
            try:
                resolve(pm, data)
            except MilesError:  # needs settings (or hardware) of its own: left out
                continue
            out.append((section, name, comp.config, base))
    from miles.config import RunConfig
    from miles_plugin_sft.config import WarmStartConfig

    out.append(("run", None, RunConfig, {}))
    out.append(("run.warm_start", None, WarmStartConfig, {}))
    from miles import config as kernel_config

    rollout_schema = getattr(kernel_config, "RolloutConfig", None)
    if rollout_schema is not None:
        out.append(("rollout", None, rollout_schema, {}))
    return out


SKIP_FIELDS = {("run", "out_dir"), ("run", "warm_start")}


def field_cases(section: str, name: str | None, schema: Any, base: dict, rng: random.Random) -> list[Case]:
    cases = []
    top = section.split(".")[0]
    for fname, info in schema.model_fields.items():
        if (section, fname) in SKIP_FIELDS or fname == "name":
            continue
        for v in bad_values(info, rng, schema):
            if name is None:
                cases.append(Case("bad value", [f"{section}.{fname}={_flat(v)}"], [f"{section}.{fname}"],
                                  section=top))
            else:
                settings = {"name": name, **base, fname: v}
                cases.append(Case("bad value", [f"{section}={_flat(settings)}"], [f"{section}.{fname}"],
                                  section=top))
    key = _word(rng)
    if name is None:
        cases.append(Case("unknown key", [f"{section}.{key}=1"], [f"{section}.{key}"], section=top))
    else:
        cases.append(Case("unknown key", [f"{section}={_flat({'name': name, **base, key: 1})}"],
                          [f"{section}.{key}"], section=top))
    return cases


def fixed_cases(rng: random.Random, tmp: Path) -> list[Case]:
    """Unknown components, missing files, conflicts across sections, broken YAML, bad overrides."""
    cases = []
    for section in SECTION_KINDS:
        cases.append(Case("unknown component", [f"{section}.name={_word(rng)}"], [f"{section}.name"],
                          section=section))
    cases += [
        Case("unknown component", [f"run.mode={_word(rng)}"], ["run.mode"], section="run"),
        Case("unknown component", [f"run.warm_start.algorithm={_word(rng)}"], ["run.warm_start.algorithm"],
             section="run"),
        Case("unknown logger", [f"loggers=[{_word(rng)}]"], ["loggers[0]"], section="loggers"),
        Case("logger setting", ["loggers=[{name: console, colour: 3}]"], ["loggers[0].colour"], section="loggers"),
        Case("unknown section", [f"{_word(rng)}.steps=3"], [], names=["unknown section"], section="zz"),
        Case("missing file", [f"model={_flat({'name': 'hf', 'path': str(tmp / 'no-model')})}"], ["model"],
             names=["model.path"], section="model"),
        Case("missing file", [f"model.tokenizer={tmp / 'no-tokenizer'}"], ["model"], names=["model.tokenizer"],
             section="model"),
        Case("missing file", [f"plugins=[{tmp / 'no-plugin.py'}]"], [], names=["no-plugin.py"]),
        Case("missing file", [], [], names=["no-plugin2.py"], argv_extra=["--plugin", str(tmp / "no-plugin2.py")]),
        Case("missing file", [], [], names=["no-config.yaml"], config_text="<missing>"),
        Case("folder as config", [], [], names=["is a folder"], config_text="<folder>"),
        Case("plugins not a list", ["plugins=5"], ["plugins"], section="plugins"),
        Case("plugins not names", ["plugins=[5]"], ["plugins"], section="plugins"),
        Case("conflict", ["model.path=/"], ["model"], names=["exactly one of model.path"], section="model"),
        Case("conflict", ["rollout.in_flight=resume"], ["rollout.in_flight"], section="rollout"),
        Case("bad override", ["=5"], [], names=["key.sub=value"]),
        Case("allow-list typo", [], [], names=["MILES_PLUGINS names nosuchplugin_x"],
             env={"MILES_PLUGINS": "nosuchplugin_x"}),
        Case("inline model", ["model.config.num_hidden_layers=0"], ["model"], names=["num_hidden_layers"],
             section="model"),
        Case("inline model", ["model.config.hidden_size=30"], ["model"], names=["hidden_size"], section="model"),
        Case("inline model", ["model.config.model_type=" + "q" * 40], ["model"], names=["model_type"],
             section="model"),
        Case("non-finite", ["trainer.lr=.inf"], ["trainer.lr"], section="trainer"),
        Case("non-finite", ["trainer.lr=.nan"], ["trainer.lr"], section="trainer"),
        Case("bad betas", ["trainer.betas=[2, 3]"], ["trainer.betas"], section="trainer"),
        Case("bad device", ["trainer.device=gpu"], ["trainer.device"], section="trainer"),
        Case("bad device", ["engine.device=tpu"], ["engine.device"], section="engine"),
    ]
    import torch

    if not torch.cuda.is_available():
        cases += [Case("no GPU", ["engine.device=cuda"], ["engine.device"], section="engine"),
                  Case("no GPU", ["trainer.device=cuda:0"], ["trainer.device"], section="trainer")]
    broken = ["run: {steps: 3\n", "run:\n  steps: [1, 2\n", ": : :\n", "run:\n\t- steps\n", "a: b: c\n",
              "run: 'unterminated\n", "- just\n- a list\n", "42\n", "\x00\x01 binary\n", "\udcff"]
    for text in broken:
        cases.append(Case("broken yaml", [], [], names=["cfg.yaml"], config_text=text))
    return cases


def combine(rng: random.Random, pool: list[Case]) -> Case:
    """2-4 problems in distinct sections at once: every one is reported, each once."""
    picked, used = [], set()
    for c in rng.sample(pool, len(pool)):
        if c.section and c.section not in used and c.keys and not c.names and not c.config_text:
            picked.append(c)
            used.add(c.section)
        if len(picked) == rng.randint(2, 4):
            break
    return Case("combined", [o for c in picked for o in c.overrides], [k for c in picked for k in c.keys])


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else b"", p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*"))}


@pytest.fixture
def run_folder(tmp_path: Path) -> Path:
    """An existing run folder (as a finished run leaves it) that no rejected command may touch."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000002" / "trainer").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(BASE))
    (run / "metrics.jsonl").write_text('{"step": 0, "eval_accuracy": 0.1}\n{"step": 1, "reward_mean": 0.2}\n')
    (run / "warm_start.jsonl").write_text('{"step": 5, "eval_accuracy": 0.1}\n')
    (run / "checkpoints" / "step_000002" / "state.json").write_text('{"step": 2, "weight_version": 2}')
    (run / "checkpoints" / "step_000002" / "trainer" / "w.bin").write_bytes(os.urandom(256))
    return run


def run_case(case: Case, run: Path, tmp: Path, capfd, monkeypatch) -> tuple[Any, str]:
    config = str(ROOT / "tests" / "tiny.yaml")
    if case.config_text == "<missing>":
        config = str(tmp / "no-config.yaml")
    elif case.config_text == "<folder>":
        config = str(tmp)
    elif case.config_text is not None:
        config = str(tmp / "cfg.yaml")
        Path(config).write_bytes(case.config_text.encode("utf-8", "surrogateescape"))
    argv = ["train", config, *case.argv_extra, f"run.out_dir={run}", *case.overrides]
    for k, v in case.env.items():
        monkeypatch.setenv(k, v)
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own usage errors
        code = e.code
    except Exception as e:  # noqa: BLE001 (escaped the CLI: a traceback for the user)
        code = f"Traceback: {type(e).__name__}: {e}"
    finally:
        for k in case.env:
            monkeypatch.delenv(k)
    out, err = capfd.readouterr()
    return code, out + err


def test_config_fuzz(run_folder: Path, tmp_path: Path, capfd, monkeypatch) -> None:
    monkeypatch.setattr(miles.plugins, "_entry_points", _cached_entry_points)  # one scan, not 500
    monkeypatch.delenv("MILES_PLUGINS", raising=False)
    rng = random.Random(SEED)
    pm = make_plugin_manager()
    singles = fixed_cases(rng, tmp_path)
    for section, name, schema, base in sections(pm):
        singles += field_cases(section, name, schema, base, rng)
    cases = singles + [combine(rng, singles) for _ in range(CASES // 4)]  # a quarter combined
    rng.shuffle(cases)
    cases = cases[:CASES]
    before, failures = snapshot(run_folder), []
    for i, case in enumerate(cases):
        code, text = run_case(case, run_folder, tmp_path, capfd, monkeypatch)
        problem = check(case, code, text)
        if problem is None and snapshot(run_folder) != before:
            problem = "the run folder changed"
        if problem:
            failures.append(f"case {i} ({case.kind}) {case.overrides or case.config_text!r}: {problem}\n"
                            f"{text[-1500:]}")
    assert len(cases) >= 500
    assert not failures, f"seed {SEED} (MILES_FUZZ_SEED): {len(failures)} of {len(cases)} cases failed; " \
                         f"the first ones:\n" + "\n".join(failures[:int(os.environ.get("MILES_FUZZ_SHOW", "8"))])


def check(case: Case, code: Any, text: str) -> str | None:
    """What is wrong with the CLI's answer to ``case``, or None."""
    if code != 2:
        return f"exit status {code}, not 2"
    if "Traceback" in text:
        return "a Python traceback"
    if len([ln for ln in text.splitlines() if ln.startswith("miles: error:")]) != 1 and "usage:" not in text:
        return "not exactly one 'miles: error:' message"
    lines = [ln.strip()[2:] for ln in text.splitlines() if ln.startswith("  - ")]
    for key in case.keys:  # each problem named once, at the start of its own line
        hits = [ln for ln in lines if ln.startswith(key) and ln[len(key):len(key) + 1] in (":", ".", "[", " ")]
        if len(hits) != 1:
            return f"{key!r} reported {len(hits)} times"
    if case.keys and len(lines) != len(case.keys):
        return f"{len(lines)} problem lines for {len(case.keys)} problems"
    missing = [n for n in case.names if n not in text]
    if missing:
        return f"{missing} not in the message"
    if len(max(text.splitlines() or [""], key=len)) > 600:
        return "a line of over 600 characters"
    return None
