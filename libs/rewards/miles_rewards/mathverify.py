"""``math``: the final answer extracted and compared symbolically by Hugging Face's math-verify.

Extraction order: the text after the last ``####`` (GSM8K), else math-verify's own extraction,
which prefers ``\\boxed{}`` and otherwise takes the last number or expression. Labels may be a
GSM8K solution (``... #### 72``), a number, or LaTeX with or without ``$`` delimiters (a label
without them is read whole as one LaTeX expression: ``\\{1, 2\\}`` is a set, not its last number).
"""
from __future__ import annotations

import threading
from typing import Any, Mapping

from .base import RewardResult
from .settings import MathSettings


def _after_hashes(text: str) -> str:
    """GSM8K's final-answer marker: the first line after the last ``####``, else ``text``."""
    if "####" not in text:
        return text
    tail = text.rsplit("####", 1)[1].strip()
    return tail.splitlines()[0] if tail else text


def _left_to_evaluate(expr: Any) -> bool:
    """Whether a parsed answer still holds arithmetic (a sum, a product of numbers, a power) rather
    than one number, a fraction, a negative or a percentage."""
    import sympy

    for node in sympy.preorder_traversal(expr):
        if isinstance(node, sympy.Add):
            return True
        if isinstance(node, sympy.Mul):
            unit = [a for a in node.args if not (a == -1 or (isinstance(a, sympy.Pow) and a.exp == -1)
                                                 or (isinstance(a, sympy.Rational) and a.p == 1))]
            if len(unit) > 1:
                return True
        if isinstance(node, sympy.Pow) and node.exp != -1:
            return True
    return False


def _canonical(value: Any) -> str:
    """A parsed answer as text for majority voting: numbers by value (0.5 and 1/2 alike)."""
    try:
        return format(float(value), ".6g")
    except (TypeError, ValueError):
        return str(value)


def _is_number(expr: Any) -> bool:
    import sympy

    return isinstance(expr, sympy.Number)


class MathReward:
    """1 when the response's final answer equals the label's (symbolic equivalence: ``0.5`` equals
    ``\\frac{1}{2}``, ``1,234`` equals ``1234``)."""

    name = "math"
    metric_names = ("math_extract_failed", "math_label_failed")

    def __init__(self, cfg: MathSettings) -> None:
        import math_verify  # imported here: the library loads sympy and the LaTeX parser

        self.cfg, self._mv = cfg, math_verify
        self._gold: dict[str, Any] = {}  # a dataset's labels repeat once per sample

    def _timeout(self) -> int | None:
        # math-verify's limit uses SIGALRM, which only the main thread may set
        on_main = threading.current_thread() is threading.main_thread()
        return self.cfg.timeout_s if on_main and self.cfg.timeout_s else None

    def parse(self, text: str) -> list:
        """math-verify's parse of the final answer in ``text`` (empty: none found)."""
        return self._mv.parse(_after_hashes(text), parsing_timeout=self._timeout())

    def gold(self, label: Any) -> list:
        key = str(label)
        if key not in self._gold:
            text = _after_hashes(key)
            parsed = []
            if "$" not in text and "\\boxed" not in text:  # a bare answer is read whole, as LaTeX
                parsed = self._mv.parse(f"${text}$", parsing_timeout=self._timeout())
            self._gold[key] = parsed or self.parse(text)
        return self._gold[key]

    def __call__(self, response: str, label: Any = None, metadata: Mapping[str, Any] | None = None, *,
                 prompt: Any = None) -> RewardResult:
        gold = self.gold(label) if label is not None else []
        got = self.parse(response)
        ok = bool(gold and got) and self._mv.verify(gold, got, float_rounding=self.cfg.float_rounding,
                                                    timeout_seconds=self._timeout())
        if ok and self.cfg.numbers_only and _is_number(gold[0]) and _left_to_evaluate(got[0]):
            ok = False
        return RewardResult(float(ok), {"math_extract_failed": float(not got), "math_label_failed": float(not gold)},
                            _canonical(got[0]) if got else None)
