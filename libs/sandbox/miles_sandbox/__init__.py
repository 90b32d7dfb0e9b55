"""miles-sandbox: ``run_python`` / ``run_shell`` for model-written code, in new namespaces (no
network, read-only host, private /tmp) with resource limits. A library: environments import it,
and the ``miles-plugin-sandbox`` distribution re-exports it as ``miles_plugin_sandbox``."""
from .sandbox import Limits, SandboxError, SandboxResult, run_python, run_shell

__all__ = ["Limits", "SandboxError", "SandboxResult", "run_python", "run_shell"]
