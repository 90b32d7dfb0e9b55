"""The kernel stays a kernel: its size only goes down (``wc -l kernel/*.py``; the target is 2,000
lines), no torch at import, and every function typed (parameters and return), so a plugin author
can read the contracts off it."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

KERNEL = Path(__file__).resolve().parents[1] / "kernel"
# a ratchet: lower it whenever code moves out to libs/ or plugins/, never raise it
MAX_LINES = 2000


def test_the_kernel_does_not_grow():
    lines = sum(len(p.read_text(encoding="utf-8").splitlines()) for p in KERNEL.glob("*.py"))
    assert lines <= MAX_LINES, f"kernel/*.py has {lines} lines; move what is not kernel to libs/ or plugins/"


def test_import_miles_imports_no_torch():
    code = "import sys, miles, miles.protocols, miles.hookspecs, miles.config; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_kernel_function_has_type_hints():
    missing = []
    for path in sorted(KERNEL.glob("*.py")):
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
