from miles.testing import *  # noqa: F401,F403  (the plugin_manager fixture, as a plugin's conftest.py has it)
