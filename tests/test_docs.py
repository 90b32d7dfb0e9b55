"""The README is a product document: the two commands first, only recipes that exist, short; and
no development history in the repository's docs, code comments or tests."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
COMMANDS = [
    "pip install -U setuptools && pip install --no-build-isolation -r requirements.txt && miles train "
    "recipes/quickstart.yaml",
    "pip install -U setuptools && pip install --no-build-isolation -r requirements.txt && python -m pytest",
]
# The check, `grep -rniE '...' README.md benchmarks kernel plugins libs recipes tests`;
# "[ ]" keeps this file's own copy of the phrase from matching it.
HISTORY = re.compile(r"(this|previous|last|earlier) session|session [0-9]+|the GPU[ ]box", re.IGNORECASE)
SEARCHED = ["README.md", "benchmarks", "kernel", "plugins", "libs", "recipes", "tests"]
SKIPPED_DIRS = {"__pycache__", ".pytest_cache", ".ruff_cache", "node_modules"}


def _files(path: Path):
    if path.is_file():
        yield path
        return
    for p in sorted(path.rglob("*")):
        if p.is_file() and not SKIPPED_DIRS.intersection(p.parts) and ".egg-info" not in str(p):
            yield p


def test_no_development_history_in_the_repository():
    hits = []
    for name in SEARCHED:
        for f in _files(ROOT / name):
            try:
                text = f.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue  # binary files (grep reports them only as "binary file matches")
            for i, line in enumerate(text.splitlines(), 1):
                if HISTORY.search(line):
                    hits.append(f"{f.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not hits, "development history (describe the software instead):\n" + "\n".join(hits)


def _first_code_block(text: str) -> list[str]:
    m = re.search(r"^```[^\n]*\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    assert m, "README.md has no code block"
    return [line.split("#", 1)[0].strip() for line in m.group(1).splitlines() if line.strip()]


def test_readme_starts_with_the_two_commands():
    assert _first_code_block(README.read_text(encoding="utf-8")) == COMMANDS


def test_every_recipe_the_readme_names_exists():
    named = set(re.findall(r"recipes/[\w.-]+\.yaml", README.read_text(encoding="utf-8")))
    assert "recipes/quickstart.yaml" in named
    missing = sorted(r for r in named if not (ROOT / r).is_file())
    assert not missing, f"README.md names recipes that do not exist: {missing}"


def test_readme_is_short():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= 300, f"README.md has {n} lines; keep it at most 300 (figures go to benchmarks/RESULTS.md)"


def test_history_pattern_matches_what_it_should():
    # built from pieces so that this file does not hold the phrases it looks for
    for bad in ("as measured in session" + " 13", "the previous " + "session's runs", "run on the GPU " + "box"):
        assert HISTORY.search(bad), bad
    assert not HISTORY.search('@pytest.fixture(scope="session")')
