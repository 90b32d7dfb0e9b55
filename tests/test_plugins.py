"""Plugin discovery, dispatch semantics and plugin errors."""
import json

import pytest

from miles import Group, Sample, Task, hookimpl
from miles.errors import PluginError
from miles.plugins import call_all, call_first, make_plugin_manager

SHOUT = """
    from miles import hookimpl

    @hookimpl
    def miles_reward(sample):
        return 7.0 if sample.response == "shout" else None
"""


@pytest.fixture(scope="module")
def installed_plugin(tmp_path_factory, install_dist):
    """A real third-party distribution, built and installed with pip into its own folder."""
    return install_dist(tmp_path_factory.mktemp("dist"), "shout", "3.1.4", SHOUT)


def test_entry_point_of_installed_distribution_is_discovered(installed_plugin, cli):
    r = cli("plugins", "--json", env={"PYTHONPATH": str(installed_plugin)})
    assert r.returncode == 0, r.stderr
    rows = {p["name"]: p for p in json.loads(r.stdout)["plugins"]}
    assert rows["shout"]["distribution"] == "miles-plugin-shout"
    assert rows["shout"]["version"] == "3.1.4"
    assert rows["shout"]["hooks"] == ["miles_reward"]
    assert "torch" in json.loads(r.stdout)["components"]["engines"]


def test_disable_autoload_and_allow_list(installed_plugin, cli):
    env = {"PYTHONPATH": str(installed_plugin), "MILES_DISABLE_PLUGIN_AUTOLOAD": "1"}
    names = [p["name"] for p in json.loads(cli("plugins", "--json", env=env).stdout)["plugins"]]
    assert names == ["miles.builtin"]
    env = {"PYTHONPATH": str(installed_plugin), "MILES_PLUGINS": "miles-plugin-shout,grpo"}
    names = {p["name"] for p in json.loads(cli("plugins", "--json", env=env).stdout)["plugins"]}
    assert names == {"miles.builtin", "shout", "grpo"}


class First:
    @hookimpl
    def miles_reward(self, sample):
        return None  # not mine


class Second:
    @hookimpl
    def miles_reward(self, sample):
        return 0.5

    @hookimpl
    def miles_filter(self, group):
        return None


class Dropper:
    @hookimpl
    def miles_filter(self, group):
        return False


def _pm(*plugins):
    pm = make_plugin_manager(autoload=False)
    for p in plugins:
        pm.register(p)
    return pm


def test_reward_is_firstresult_and_none_falls_through():
    s = Sample(task=Task("p"))
    assert call_first(_pm(Second(), First()), "miles_reward", sample=s) == 0.5
    assert call_first(_pm(First()), "miles_reward", sample=s) is None


def test_filter_calls_every_implementation_and_false_drops():
    g = Group(Task("p"), [])
    assert call_all(_pm(Second(), Dropper()), "miles_filter", group=g) == [False]
    assert False not in call_all(_pm(Second()), "miles_filter", group=g)


def test_exception_in_hook_names_hook_and_plugin():
    class Broken:
        @hookimpl
        def miles_reward(self, sample):
            raise ZeroDivisionError("boom")

    pm = _pm()
    pm.register(Broken(), name="broken-plugin")
    with pytest.raises(PluginError, match="broken-plugin.*miles_reward.*boom"):
        call_first(pm, "miles_reward", sample=Sample(task=Task("p")))


def test_duplicate_component_names_are_an_error():
    class A:
        @hookimpl
        def miles_register_envs(self, register):
            register("dup", object)

    pm = _pm()
    pm.register(A(), name="plugin-a")
    pm.register(A(), name="plugin-b")
    with pytest.raises(PluginError, match="'dup' is registered twice.*plugin-a|plugin-b"):
        pm.registry("envs")


def test_launch_time_py_file_is_registered(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text("from miles import hookimpl\n@hookimpl\ndef miles_reward(sample):\n    return 1.25\n")
    pm = make_plugin_manager(extra=[str(f)], autoload=False)
    assert call_first(pm, "miles_reward", sample=Sample(task=Task("p"))) == 1.25


def test_plugin_that_raises_on_import_is_named(tmp_path):
    f = tmp_path / "bad_plugin.py"
    f.write_text("raise RuntimeError('cannot start')\n")
    with pytest.raises(PluginError, match="bad_plugin.py failed to import.*cannot start"):
        make_plugin_manager(extra=[str(f)], autoload=False)
    with pytest.raises(PluginError, match="does not exist"):
        make_plugin_manager(extra=[str(tmp_path / "missing.py")], autoload=False)
