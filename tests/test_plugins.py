"""Plugin discovery, dispatch semantics and plugin errors."""
import json

import pytest

from miles import Group, Sample, Task, hookimpl
from miles.errors import PluginError
from miles.plugins import make_plugin_manager

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
    assert _pm(Second(), First()).hook.miles_reward(sample=s) == 0.5
    assert _pm(First()).hook.miles_reward(sample=s) is None


def test_filter_calls_every_implementation_and_false_drops():
    g = Group(Task("p"), [])
    assert _pm(Second(), Dropper()).hook.miles_filter(group=g) == [False]
    assert False not in _pm(Second()).hook.miles_filter(group=g)


def test_exception_in_hook_names_hook_and_plugin():
    class Broken:
        @hookimpl
        def miles_reward(self, sample):
            raise ZeroDivisionError("boom")

    pm = _pm()
    pm.register(Broken(), name="broken-plugin")
    with pytest.raises(PluginError, match="broken-plugin.*miles_reward.*boom"):
        pm.hook.miles_reward(sample=Sample(task=Task("p")))


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
    assert pm.hook.miles_reward(sample=Sample(task=Task("p"))) == 1.25


def test_plugin_that_raises_on_import_is_named(tmp_path):
    f = tmp_path / "bad_plugin.py"
    f.write_text("raise RuntimeError('cannot start')\n")
    with pytest.raises(PluginError, match="bad_plugin.py failed to import.*cannot start"):
        make_plugin_manager(extra=[str(f)], autoload=False)
    with pytest.raises(PluginError, match="does not exist"):
        make_plugin_manager(extra=[str(tmp_path / "missing.py")], autoload=False)


# --- hooks are dispatched by pluggy: wrappers, ordering and argument subsets behave as documented --
class Rescale:
    """A new-style wrapper around every other miles_reward implementation."""

    @hookimpl(wrapper=True)
    def miles_reward(self, sample):
        inner = yield
        return None if inner is None else inner * 10


class Early:
    @hookimpl(tryfirst=True)
    def miles_reward(self):  # an argument subset: no ``sample``
        return 0.25


def test_a_wrapper_rescales_the_inner_reward():
    s = Sample(task=Task("p"))
    assert _pm(Second(), Rescale()).hook.miles_reward(sample=s) == 5.0
    assert _pm(First(), Rescale()).hook.miles_reward(sample=s) is None  # "not mine" passes through


def test_tryfirst_orders_two_reward_plugins_whatever_the_registration_order():
    s = Sample(task=Task("p"))
    assert _pm(Early(), Second()).hook.miles_reward(sample=s) == 0.25
    assert _pm(Second(), Early()).hook.miles_reward(sample=s) == 0.25


def test_a_filter_wrapper_sees_and_changes_every_verdict():
    class KeepAll:
        @hookimpl(wrapper=True)
        def miles_filter(self, group):
            verdicts = yield
            return [v for v in verdicts if v is not False]

    g = Group(Task("p"), [])
    assert _pm(Dropper(), Second()).hook.miles_filter(group=g) == [False]
    assert False not in _pm(Dropper(), Second(), KeepAll()).hook.miles_filter(group=g)


def test_the_loop_filters_and_rewards_through_pluggy(tmp_path):
    """The kernel's rollout service goes through ``pm.hook``: a wrapper reaches a real run's rewards."""
    from types import SimpleNamespace

    from miles.rollouts import RolloutService

    pm = _pm(Second(), Rescale(), Dropper())
    env = SimpleNamespace(reward=lambda s: 0.0)
    service = RolloutService(pm, None, None, env, None, SimpleNamespace(keep=lambda g: True), console=lambda t: None)
    s = Sample(task=Task("p"))
    service.score(s)
    assert s.reward == 5.0
    assert service.keep(Group(Task("p"), [s])) is False


def test_a_reward_that_is_not_a_finite_number_excludes_the_sample_and_names_the_plugin():
    from types import SimpleNamespace

    from miles.rollouts import RolloutService

    class Bad:
        @hookimpl
        def miles_reward(self, sample):
            return float("nan") if sample.task.prompt == "nan" else "0.5"

    pm, said = _pm(), []
    pm.register(Bad(), name="bad-reward")
    service = RolloutService(pm, None, None, SimpleNamespace(), None, None, console=said.append)
    for prompt in ("nan", "text"):
        s = Sample(task=Task(prompt), response_ids=[1, 2], logprobs=[0.0, 0.0])
        service.score(s)
        assert s.reward == 0.0 and s.loss_mask == [0, 0] and s.status.value == "failed"
    assert len(said) == 1 and "bad-reward" in said[0]
    assert service.metrics([])["rewards_invalid"] == 2.0


def test_a_bad_reward_is_traced_to_its_plugin_without_asking_any_plugin_twice():
    """A remote judge must not score a sample twice to find who returned a bad value: every
    implementation runs at most once per sample, in pluggy's order (tryfirst, then the latest)."""
    from types import SimpleNamespace

    from miles.rollouts import RolloutService

    calls: list[str] = []

    def counted(name, value, **opts):
        class Impl:
            @hookimpl(**opts)
            def miles_reward(self, sample):
                calls.append(name)
                return value
        return Impl()

    pm, said = _pm(), []
    pm.register(counted("judge", float("inf")), name="judge")
    pm.register(counted("after", 1.0, trylast=True), name="after")  # never reached: judge answered
    pm.register(counted("first", None, tryfirst=True), name="first")
    service = RolloutService(pm, None, None, SimpleNamespace(), None, None, console=said.append)
    s = Sample(task=Task("p"), response_ids=[1], logprobs=[0.0])
    service.score(s)
    assert calls == ["first", "judge"]
    assert s.status.value == "failed" and len(said) == 1 and "plugin judge (miles_reward)" in said[0], said
    pm.register(Rescale(), name="rescale")  # a wrapper: pluggy calls them, still once each
    calls.clear()
    service.score(Sample(task=Task("p"), response_ids=[1], logprobs=[0.0]))
    assert calls == ["first", "judge"]
