"""The kernel stays a kernel: ``import miles`` imports no torch, dependencies run one way (no
library the kernel imports imports ``miles`` back), and every public function is typed (parameters
and return), so a plugin author can read the contracts off it."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

KERNEL = Path(__file__).resolve().parents[1] / "kernel"
SOURCES = sorted(KERNEL.rglob("*.py"))


def _imported_top_modules(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_libraries_the_kernel_imports_never_import_miles():
    """The kernel may use libraries of its own (``miles_tokens``); none may import ``miles``
    back, or the kernel could not be read, installed or tested without its own plugins' layer."""
    import importlib.util

    libs = sorted({m for p in SOURCES for m in _imported_top_modules(p) if m.startswith("miles_")})
    assert libs, "the kernel imports no miles_* library; update this test's premise"
    offenders = []
    for lib in libs:
        origin = Path(importlib.util.find_spec(lib).origin).parent
        offenders += [f"{lib}: {p.name}" for p in origin.rglob("*.py") if "miles" in _imported_top_modules(p)]
    assert not offenders, "libraries the kernel imports must not import miles:\n" + "\n".join(offenders)


def test_kernel_imports_only_its_declared_dependencies():
    """Plugins are found through entry points, never imported by name from the kernel."""
    imported = {m for p in SOURCES for m in _imported_top_modules(p)}
    assert not {m for m in imported if m.startswith("miles_plugin")}, imported


def test_import_miles_imports_no_torch():
    code = "import sys, miles, miles.protocols, miles.hookspecs, miles.config; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_kernel_function_has_type_hints():
    missing = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            a = node.args
            params = [p for p in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg]
                      if p is not None and p.arg not in ("self", "cls")]
            untyped = [p.arg for p in params if p.annotation is None] + (["return"] if node.returns is None else [])
            if untyped:
                missing.append(f"{path.name}:{node.lineno} {node.name}: {', '.join(untyped)}")
    assert not missing, "untyped:\n" + "\n".join(missing)
