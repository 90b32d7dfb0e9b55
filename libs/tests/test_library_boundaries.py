"""Where shared code may be imported from: no plugin imports another plugin (shared code lives in
``libs/``), and a library uses only the kernel's public names (``from miles import X``), never its
modules. Checked on the source, so a new plugin or library is covered as soon as it exists."""
from __future__ import annotations

import ast
from pathlib import Path

import miles

ROOT = Path(__file__).resolve().parents[2]
# test doubles for other packages' tests may build plugin managers and tiny specs
LIBRARY_TEST_HELPERS = {"testing.py"}
# (importing plugin, imported plugin) pairs still to be moved behind a kernel protocol or into libs/;
# each entry is checked to still exist, so a fixed one must be removed from here
KNOWN_PLUGIN_IMPORTS: set[tuple[str, str]] = set()


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every import statement of a file (relative imports left out)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module, [a.name for a in node.names]))
    return out


def _package_files(pattern: str) -> list[Path]:
    return [p for p in sorted(ROOT.glob(pattern)) if "/tests/" not in str(p) and ".egg-info" not in str(p)]


def test_no_plugin_imports_another_plugin():
    bad, seen = [], set()
    for path in _package_files("plugins/*/*/miles_plugin_*/**/*.py"):
        own = next(part for part in path.relative_to(ROOT).parts if part.startswith("miles_plugin_"))
        for line, module, _ in _imports(path):
            top = module.split(".")[0]
            if top.startswith("miles_plugin_") and top != own:
                seen.add((own, top))
                if (own, top) not in KNOWN_PLUGIN_IMPORTS:
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not bad, "a plugin imports another plugin (move the shared code to libs/):\n" + "\n".join(bad)
    assert not KNOWN_PLUGIN_IMPORTS - seen, f"no longer imported, remove: {KNOWN_PLUGIN_IMPORTS - seen}"


def test_libraries_use_only_the_kernel_s_public_names():
    public = set(miles.__all__)
    bad = []
    for path in _package_files("libs/*/miles_*/**/*.py"):
        if path.name in LIBRARY_TEST_HELPERS:
            continue
        for line, module, names in _imports(path):
            where = f"{path.relative_to(ROOT)}:{line}"
            if module == "miles.protocols":  # the contracts are public, like miles.__all__
                continue
            if module.startswith("miles."):
                bad.append(f"{where} imports the kernel module {module}")
            elif module == "miles" and not names:
                bad.append(f"{where} imports the whole kernel (use `from miles import X`)")
            elif module == "miles":
                bad += [f"{where} imports miles.{n}, not a public name" for n in names if n not in public]
            elif module.startswith("miles_plugin_"):
                bad.append(f"{where} imports the plugin {module}")
    assert not bad, "\n".join(bad)
