"""``code``: the response's program run against the row's tests in the sandbox (``miles_sandbox``),
scored as the fraction of tests that pass.

Tests (``metadata[tests_key]``, else the label) are either Python statements (``"assert f(2) == 4"``,
MBPP/HumanEval style), all run in one sandbox process after the program, or ``{"input", "output"}``
pairs (stdin -> expected stdout, APPS/CodeContests style; also ``{"inputs": [...], "outputs": [...]}``),
one process each. A JSON string of either is decoded first.
"""
from __future__ import annotations

import json
import re
import secrets
from typing import Any, Mapping

from .base import RewardConfigError, RewardResult
from .settings import CodeSettings

_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)

# Runs the program, then each test in the program's namespace; a passing test prints a random
# marker and its index at once, so the tests that passed before a timeout still count. Like any
# in-process harness (HumanEval's too) it stops accidents, not a program written to forge results.
_HARNESS = """\
import json, os, sys


def main():
    marker = open("marker.txt").read()
    os.remove("marker.txt")  # kept only in this frame: the program cannot read it from disk
    ns = {"__name__": "__main__"}
    try:
        exec(compile(open("setup.py").read() + "\\n" + open("solution.py").read(), "solution.py", "exec"), ns)
    except BaseException as e:
        print("program failed:", type(e).__name__, e, file=sys.stderr)
        return
    for i, test in enumerate(json.load(open("tests.json"))):
        try:
            exec(compile(test, f"test_{i}", "exec"), ns)
        except BaseException as e:
            print(f"test {i} failed:", type(e).__name__, e, file=sys.stderr)
            continue
        print(marker, i, flush=True)


main()
"""


def extract_code(response: str) -> tuple[str, bool]:
    """The program in a response: its last fenced block marked python (else its last fenced
    block), or the whole response when it has none. Second value: a fenced block was found."""
    blocks = _FENCE.findall(response)
    if not blocks:
        return response.strip(), False
    python = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    return (python or [body for _, body in blocks])[-1].strip(), True


def load_tests(raw: Any) -> tuple[str, list]:
    """``("asserts", [statement, ...])`` or ``("io", [(stdin, stdout), ...])``."""
    if isinstance(raw, str) and raw.strip()[:1] in ("[", "{"):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            pass
    if isinstance(raw, str):
        return "asserts", [raw]
    if isinstance(raw, Mapping) and "inputs" in raw and "outputs" in raw:
        return "io", [(str(i), str(o)) for i, o in zip(raw["inputs"], raw["outputs"])]
    if isinstance(raw, (list, tuple)) and raw and all(isinstance(t, str) for t in raw):
        return "asserts", list(raw)
    if isinstance(raw, (list, tuple)) and raw and all(isinstance(t, Mapping) and "input" in t and "output" in t
                                                      for t in raw):
        return "io", [(str(t["input"]), str(t["output"])) for t in raw]
    raise RewardConfigError(f"code tests must be a non-empty list of assert statements or of {{input, output}} "
                            f"pairs (or a JSON string of one); got {type(raw).__name__} {str(raw)[:80]!r}")


def _same_output(got: str, want: str) -> bool:
    """Outputs compared line by line, trailing whitespace ignored."""
    lines = lambda s: [ln.rstrip() for ln in s.strip().splitlines()]  # noqa: E731
    return lines(got) == lines(want)


class CodeReward:
    """Fraction of the row's tests the response's program passes (see the module docstring)."""

    name = "code"
    metric_names = ("code_no_block", "code_timeouts", "code_all_passed")

    def __init__(self, cfg: CodeSettings) -> None:
        from miles_sandbox import Limits  # imported here: only this reward needs the sandbox

        self.cfg, self.limits = cfg, Limits(memory_mb=cfg.memory_mb)

    def __call__(self, response: str, label: Any = None, metadata: Mapping[str, Any] | None = None, *,
                 prompt: Any = None) -> RewardResult:
        meta = metadata or {}
        kind, tests = load_tests(meta.get(self.cfg.tests_key, label))
        code, fenced = extract_code(response)
        setup = str(meta.get(self.cfg.setup_key) or "")
        total, run = len(tests), tests[:self.cfg.max_tests]
        passed, timed_out = self._asserts(code, setup, run) if kind == "asserts" else self._io(code, run)
        return RewardResult(passed / total, {"code_no_block": float(not fenced), "code_timeouts": float(timed_out),
                                             "code_all_passed": float(passed == total)}, code or None)

    def _asserts(self, code: str, setup: str, tests: list[str]) -> tuple[int, bool]:
        from miles_sandbox import run_python

        marker = f"passed-{secrets.token_hex(8)}"  # the program cannot print it by chance
        r = run_python(_HARNESS, self.cfg.timeout_s, limits=self.limits,
                       files={"solution.py": code, "setup.py": setup, "tests.json": json.dumps(tests),
                              "marker.txt": marker})
        done = {line.split()[1] for line in r.stdout.splitlines() if line.startswith(marker + " ")}
        return len(done), r.timed_out

    def _io(self, code: str, tests: list[tuple[str, str]]) -> tuple[int, bool]:
        from miles_sandbox import run_python

        passed, timed_out = 0, False
        for stdin, want in tests:
            r = run_python(code, self.cfg.timeout_s, limits=self.limits, stdin=stdin)
            timed_out |= r.timed_out
            passed += r.returncode == 0 and not r.timed_out and _same_output(r.stdout, want)
        return passed, timed_out
