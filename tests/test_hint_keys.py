"""Every config key that an error message names exists in a schema: a hint that names a key must
name one the user can set."""
import ast
import re
from pathlib import Path

from miles.config import RolloutConfig, RunConfig
from miles_plugin_sft.config import WarmStartConfig
from miles.plugins import SECTION_KINDS, make_plugin_manager

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("run", "rollout", *SECTION_KINDS)
KEY = re.compile(rf"(?<![\w.])({'|'.join(SECTIONS)})\.([a-z_][a-z0-9_]*)(?:\.([a-z_][a-z0-9_]*))?(?![\w(])")


def _fields(model) -> set[str]:
    return set(getattr(model, "model_fields", {}) or ())


def _schema_keys() -> dict[str, set[str]]:
    pm = make_plugin_manager()
    keys = {s: {"name"} for s in SECTION_KINDS}
    for section, kind in SECTION_KINDS.items():
        for comp in pm.registry(kind).values():
            keys[section] |= _fields(comp.config)
    keys["run"] = _fields(RunConfig)
    keys["rollout"] = _fields(RolloutConfig).union(*(_fields(c.config) for k in ("modes", "rollouts")
                                                   for c in pm.registry(k).values()))
    keys["run.warm_start"] = _fields(WarmStartConfig)
    return keys


def _error_texts(path: Path) -> list[str]:
    """String parts of every ``raise`` and every ``problems.append(...)`` in a source file."""
    texts = []
    for node in ast.walk(ast.parse(path.read_text())):
        is_append = isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "append" \
            and "problem" in ast.unparse(node.func.value)
        if isinstance(node, ast.Raise) or is_append:
            texts += [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    return texts


def test_every_key_named_in_an_error_exists():
    keys, missing = _schema_keys(), []
    files = [p for d in ("kernel", "plugins", "libs") for p in (ROOT / d).rglob("*.py") if "/tests/" not in str(p)]
    assert len(files) > 50
    for path in files:
        for text in _error_texts(path):
            for section, key, sub in KEY.findall(text):
                ok = key in keys[section] or (sub and f"{section}.{key}" in keys and sub in keys[f"{section}.{key}"])
                if not ok and not (section == "model" and key in ("base", "config")):
                    missing.append(f"{path.relative_to(ROOT)}: {section}.{key}")
    assert not missing, "error messages name keys no schema has:\n" + "\n".join(sorted(set(missing)))
