"""The env's tools: a calculator (a pure function, run in-process) and, when
``miles-sandbox`` is installed, a ``python`` tool that runs code in its sandbox."""
from __future__ import annotations

import ast
import importlib.util
import operator

CALCULATOR = {"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression of integers and decimals with + - * / // % ** "
                   "and parentheses; returns the exact result.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}

PYTHON = {"type": "function", "function": {
    "name": "python",
    "description": "Run a Python program in a sandbox (no network, time and memory limits) and return "
                   "what it prints.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_DIGITS = 1000  # a model-written 9**9**9 must not hang the rollout


class ToolError(ValueError):
    """A bad tool call; its message is what the model is shown."""


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) * max(len(str(abs(int(left)))), 1) > _MAX_DIGITS:
            raise ToolError("result too large")
        try:
            return _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
    raise ToolError("unsupported expression")


def calculator(expression: str) -> str:
    """The exact value of an arithmetic expression (integers stay integers; ``7/2`` is ``3.5``)."""
    if not isinstance(expression, str) or not expression.strip():
        raise ToolError("expression must be a non-empty string")
    if len(expression) > 200:
        raise ToolError("expression too long")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolError("invalid expression") from None
    value = _eval(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def sandbox_available() -> bool:
    return importlib.util.find_spec("miles_sandbox") is not None


def run_python_tool(code: str, timeout_s: float) -> str:
    """``code`` run by the sandbox; what it printed (stderr too when it failed)."""
    from miles_sandbox import run_python  # optional: offered only when installed

    if not isinstance(code, str) or not code.strip():
        raise ToolError("code must be a non-empty string")
    r = run_python(code, timeout_s=timeout_s)
    if r.timed_out:
        raise ToolError(f"timed out after {timeout_s:g} s")
    if r.returncode != 0:
        raise ToolError((r.stderr or r.stdout or f"exit code {r.returncode}").strip()[-500:])
    return r.stdout.strip()
