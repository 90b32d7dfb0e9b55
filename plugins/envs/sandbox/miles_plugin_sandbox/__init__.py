"""miles sandbox: ``run_python`` / ``run_shell`` for model-written code (tool-use environments).

The plugin registers no components; its functions live in the ``miles-sandbox`` library (which
environments import, since a plugin never imports another plugin) and are re-exported here.
"""
from miles_sandbox import Limits, SandboxError, SandboxResult, run_python, run_shell

__all__ = ["Limits", "SandboxError", "SandboxResult", "run_python", "run_shell"]
