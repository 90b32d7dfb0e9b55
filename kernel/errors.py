"""User-facing errors: the CLI prints their message (no traceback) and exits non-zero."""


class MilesError(Exception):
    """A problem the user can fix (bad config, missing file, broken plugin). ``str()`` says how."""

    exit_code = 2


class ConfigError(MilesError):
    """One or more invalid config keys/values; the message lists every problem at once."""

    def __init__(self, problems: list[str], source: str = "config") -> None:
        self.problems = problems
        super().__init__(f"{source}: {len(problems)} problem(s):\n" + "\n".join(f"  - {p}" for p in problems))


class PluginError(MilesError):
    """A plugin failed to load or raised inside a hook; the message names the plugin."""


class EngineRestarted(MilesError):
    """An engine came back (after a crash) without the current weights. Raised by an engine client
    from ``generate``; the loop re-syncs weights and redoes the rollout it interrupted."""
