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
    out_dir: Path | None = None  # a run folder of its own (a filesystem state) instead of the shared one


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
    elif ann is int:  # strict types: a bool or a numeric string is no count
        out = ["many", 2.5, [1], {"a": 1}, rng.choice([True, False]), str(rng.randint(1, 9))]
    elif ann is float:
        out = ["fast", [0.5], {"a": 1}, rng.choice([True, False])]
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


def _nested(rng: random.Random) -> str:
    if rng.random() < 0.5:  # flow style, up to the 5,000 levels that once overflowed the stack
        depth = rng.choice([65, 100, rng.randint(66, 5000)])
        return "[" * depth + "]" * depth
    return "\n" + "".join(f"{'  ' * (i + 2)}-\n" for i in range(rng.randint(65, 200)))  # block style


def _bomb(rng: random.Random) -> str:
    """A small document whose aliases expand past the loader's cap (width ** depth values)."""
    width, depth = rng.choice([(9, 8), (10, 7), (4, 12), (32, 5)])
    lines = ["a0: &a0 [" + ", ".join(["lol"] * width) + "]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]" for i in range(1, depth)]
    return "\n".join(lines) + "\n"


PLUGIN_FAULTS = {  # launch-time plugin bodies, each with a phrase its error must contain
    "exit at import": ("import sys\nsys.exit({n})\n", "SystemExit"),
    "raise at import": ("raise {exc}('plugin broke on import')\n", "failed to import"),
    "junk factory": ("@hookimpl\ndef miles_register_{kind}(register):\n    register('junk', {junk})\n",
                     "not callable"),
    "validate says a string": ("@hookimpl\ndef miles_validate_config(config):\n    return 'trainer.lr: x{n}'\n",
                               "trainer.lr: x"),
    "validate says junk": ("@hookimpl\ndef miles_validate_config(config):\n    return {junk}\n",
                           "miles_validate_config of plugin"),
    "validate raises": ("@hookimpl\ndef miles_validate_config(config):\n    raise {exc}('no')\n",
                        "failed in miles_validate_config"),
    "hook without hookimpl": ("def miles_reward(sample):\n    return 1.0\n", "without @hookimpl"),
}


def hardening_cases(rng: random.Random, tmp: Path) -> list[Case]:
    """Input classes that once gave tracebacks, silently wrong runs or stray files: YAML structure
    and size, overrides under a scalar, misbehaving plugins, and run folders in odd states."""
    base_text = (ROOT / "tests" / "tiny.yaml").read_text()
    cases = []
    for _ in range(6):
        section = rng.choice(["run", "rollout", "env", "trainer", "model"])
        cases.append(Case("duplicate key", [], [], names=[f"duplicate key '{section}'"],
                          config_text=base_text + f"{section}: {{}}\n"))
        inner = rng.choice(["steps", "seed"])
        cases.append(Case("duplicate key", [], [], names=[f"duplicate key '{inner}'"],
                          config_text=f"run:\n  {inner}: 1\n  out_dir: x\n  {inner}: 2\n"))
        cases.append(Case("deep yaml", [], [], names=["nested more than"], config_text=f"run:\n  x: {_nested(rng)}\n"))
        cases.append(Case("alias bomb", [], [], names=["through its aliases"], config_text=_bomb(rng)))
        cases.append(Case("deep override", [f"run.x={'[' * 80}{']' * 80}"], [], names=["nested more than"]))
        section = rng.choice(["run", "rollout", "env", "trainer", "model", "engine"])
        cases.append(Case("override under a scalar", [f"{section}={rng.randint(0, 9)}", f"{section}.{_word(rng)}=1"],
                          [], names=["not a mapping"]))
        cases.append(Case("impossible size", [f"rollout.n={rng.randint(10**8, 10**10)}"], [], names=["GiB of memory"]))
        cases.append(Case("seed overflow", [f"run.seed={rng.choice([2**32, 2**64, 10**30])}"], ["run.seed"],
                          section="run"))
    cases.append(Case("huge config", [], [], names=["MiB"], config_text="# pad\n" * (3 << 20)))
    for kind, (body, said) in PLUGIN_FAULTS.items():
        for j in range(3):
            path = tmp / f"fault_{kind.replace(' ', '_')}_{j}.py"
            junk = rng.choice(["5", "[1, 2]", "{'a': 1}"] + (["'text'"] if kind == "junk factory" else []))
            path.write_text("from miles import hookimpl\n" + body.format(
                n=rng.randint(0, 9), exc=rng.choice(["RuntimeError", "KeyError", "ValueError"]),
                kind=rng.choice(["loggers", "envs", "engines"]), junk=junk))
            extra = ["run.steps=true"] if kind == "hook without hookimpl" else []  # refused after the warning
            cases.append(Case(f"plugin: {kind}", extra, [], names=[said], argv_extra=["--plugin", str(path)]))
    for device in ("/dev/zero", "/dev/null"):
        cases.append(Case("device as config", [], [], names=["not a regular file"], config_text=f"<{device}>"))
        cases.append(Case("device as plugin", [], [], names=["not a regular file"], argv_extra=["--plugin", device]))
    fs = tmp / "fs"
    fs.mkdir()
    (fs / "file").write_text("x")
    (fs / "ckpt").mkdir()
    (fs / "ckpt" / "checkpoints").write_text("")
    (fs / "other").mkdir()
    (fs / "other" / "notes.txt").write_text("mine")
    (fs / "loop").symlink_to(fs / "loop2")
    (fs / "loop2").symlink_to(fs / "loop")
    for out, said in ((fs / "file", "is a file"), (fs / "ckpt", "checkpoints is a file"),
                      (fs / "other", "holds no miles run"), (fs / "loop", "symlink"),
                      (Path("/proc") / _word(rng), "not writable"), (Path("/sys/kernel") / _word(rng), "not writable")):
        cases.append(Case("run folder state", [], [], names=[said], out_dir=out))
    for change, listed in (("env.digits=2", "env.digits"), ("algorithm.name=gspo", "algorithm.name"),
                           ("model.config.model_type=llama", "model.config.model_type"),
                           ("trainer.name=megatron", "trainer")):
        cases.append(Case("resume that changes the checkpoint", [change, "run.warm_start=null"], [],
                          names=[listed] + (["trained under other settings"] if "megatron" not in change else [])))
    cases.append(Case("fewer steps than trained", ["run.steps=1", "run.warm_start=null"], [],
                      names=["already trained 2 steps"]))
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
    elif case.config_text in ("</dev/zero>", "</dev/null>"):
        config = case.config_text[1:-1]
    elif case.config_text is not None:
        config = str(tmp / "cfg.yaml")
        Path(config).write_bytes(case.config_text.encode("utf-8", "surrogateescape"))
    argv = ["train", config, *case.argv_extra, f"run.out_dir={case.out_dir or run}", *case.overrides]
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
    cwd = tmp_path / "cwd"  # where a stray relative run folder (./runs/default) would appear
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    rng = random.Random(SEED)
    pm = make_plugin_manager()
    singles = fixed_cases(rng, tmp_path)
    for section, name, schema, base in sections(pm):
        singles += field_cases(section, name, schema, base, rng)
    hardening = hardening_cases(rng, tmp_path)  # every one runs; the rest are sampled
    rest = singles + [combine(rng, singles) for _ in range(CASES // 4)]  # a quarter combined
    rng.shuffle(rest)
    cases = hardening + rest[:max(CASES - len(hardening), 0)]
    rng.shuffle(cases)
    before, failures, clean = snapshot(run_folder), [], 0
    for i, case in enumerate(cases):
        own = snapshot(case.out_dir) if case.out_dir is not None and case.out_dir.is_dir() else None
        code, text = run_case(case, run_folder, tmp_path, capfd, monkeypatch)
        stray = snapshot(run_folder) != before or any(cwd.iterdir()) or (
            case.out_dir is not None and own != (snapshot(case.out_dir) if case.out_dir.is_dir() else None))
        clean += code in (0, 1, 2) and "Traceback" not in text and not stray
        problem = check(case, code, text) or ("a file was left behind or changed" if stray else None)
        if problem:
            failures.append(f"case {i} ({case.kind}) {case.overrides or case.argv_extra or case.config_text!r:.300}: "
                            f"{problem}\n{text[-1500:]}")
    with capfd.disabled():
        print(f"\nconfig fuzz (seed {SEED}): {len(cases)} cases, {len(hardening)} of them the hardening "
              f"classes; {clean} clean ({100 * clean / len(cases):.1f}%: exit 0/1/2, no traceback, no "
              f"stray files); {len(cases) - len(failures)} with the exact expected message")
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
