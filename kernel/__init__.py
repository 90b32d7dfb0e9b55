"""miles: a tiny pluggy microkernel for RL post-training. Everything else is a plugin."""
from .errors import ConfigError, EngineRestarted, MilesError, PluginError
from .hookspecs import hookimpl, hookspec
from .plugins import make_plugin_manager
from .types import Batch, Completion, Group, Sample, SamplingParams, Status, Task

__version__ = "0.1.0"
__all__ = ["hookimpl", "hookspec", "make_plugin_manager", "Task", "Sample", "Group", "Batch", "Completion",
           "SamplingParams", "Status", "MilesError", "ConfigError", "PluginError", "EngineRestarted"]
