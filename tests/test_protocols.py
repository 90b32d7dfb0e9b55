"""Every contract between components is a protocol in ``miles.protocols`` that the real components
satisfy: ``isinstance`` checks on them, a component that lacks a member is refused by name, and the
hook specs' parameters are typed with those protocols."""
import typing
from pathlib import Path

import pytest
import torch

import miles.config as config
import miles.hookspecs as hookspecs
import miles.plugins as plugins
import miles.protocols as P
import miles.types as types
from miles import MilesError
from miles.config import apply_overrides, read_yaml, resolve
from miles.loop import Loop
from miles.plugins import make_plugin_manager

TINY = str(Path(__file__).with_name("tiny.yaml"))


@pytest.fixture(scope="module")
def pm():
    return make_plugin_manager()


@pytest.fixture(scope="module")
def built(pm, tmp_path_factory):
    """The tiny run's components, as ``miles export`` builds them (no engine, a trainer)."""
    out = tmp_path_factory.mktemp("run")
    loop = Loop(pm, resolve(pm, apply_overrides(read_yaml(TINY), [f"run.out_dir={out}"])))
    loop.build(with_engine=False)
    loop.new_trainer()
    return loop


def test_the_loop_is_the_run_context_its_phases_commands_and_launchers_use(built):
    assert isinstance(built, P.RunContext)
    c = built.components
    assert isinstance(c.env, P.Env) and isinstance(c.spec, P.ModelSpec) and isinstance(c.spec, P.Exports)
    assert isinstance(c.algorithm, P.Algorithm) and isinstance(c.trainer, P.Trainer)
    assert isinstance(c.transport, P.Transport) and isinstance(built.rollout_component, P.Rollout)


def test_export_writes_a_folder_and_a_spec_that_cannot_is_named(built, tmp_path, monkeypatch):
    built.export(str(tmp_path / "hf"))
    assert (tmp_path / "hf" / "config.json").is_file()

    class Bare:  # a model spec without save_pretrained
        def build_tokenizer(self, default=None):
            return None

        def build_model(self, tokenizer):
            return torch.nn.Linear(1, 1)

    monkeypatch.setattr(built.components, "spec", Bare())
    with pytest.raises(MilesError, match=r"model spec 'hf' cannot write a Hugging Face folder.*Exports.*needs it"):
        built.export(str(tmp_path / "no"), why=", which the test needs it")


def test_every_registered_algorithm_is_one_and_those_with_a_critic_are_critic_algorithms(pm):
    made = {}
    for name, comp in pm.registry("algorithms").items():
        try:
            settings = comp.config.model_validate({}) if comp.config is not None else None
        except ValueError:  # settings without defaults (e.g. a teacher to distill): covered by its plugin
            continue
        made[name] = pm.create("algorithms", name, settings)
    assert {"grpo", "ppo", "sft", "reinforce-pp"} <= set(made), sorted(made)
    for name, algo in made.items():
        assert isinstance(algo, P.Algorithm), name
        assert algo.needs_critic == isinstance(algo, P.CriticAlgorithm), name
    assert made["ppo"].needs_critic and made["ppo"].critic_lr is None  # None: the trainer's lr


def test_an_algorithm_that_needs_a_critic_without_a_value_loss_is_refused_by_name(pm, tmp_path):
    from miles import hookimpl

    class Half:
        uses_rollout, needs_reference, needs_critic = True, False, True
        keep = advantages = loss = None  # an Algorithm, but no critic_lr / value_loss

    class Provider:
        @hookimpl
        def miles_register_algorithms(self, register):
            register("half-critic", lambda cfg, **_: Half())

    local = make_plugin_manager()
    local.register(Provider(), name="half-critic")
    cfg = resolve(local, apply_overrides(read_yaml(TINY), [f"run.out_dir={tmp_path}", "algorithm.name=half-critic"]))
    with pytest.raises(MilesError, match=r"'half-critic' sets needs_critic.*CriticAlgorithm"):
        Loop(local, cfg).build(with_engine=False)


def test_batch_to_moves_every_tensor_and_keeps_the_rest():
    from miles import Sample, Task

    b = types.Batch.from_samples([Sample(Task("p"), prompt_ids=[1, 2], response_ids=[3])], pad_id=0)
    b.extras = {"values": torch.ones(1, 1, dtype=torch.float64), "note": "kept"}
    moved = b.to(torch.device("meta"))  # a device no tensor of the batch is on
    assert moved.input_ids.device.type == moved.loss_mask.device.type == "meta"
    assert moved.extras["values"].device.type == "meta" and moved.extras["note"] == "kept"
    assert moved.samples is b.samples and b.input_ids.device.type == "cpu"


def test_hook_parameters_are_typed_with_the_kernels_protocols():
    """The hook specs' annotations resolve (the names they use exist) and name protocols, not Any."""
    names = {**vars(P), **vars(types), "Config": config.Config, "MilesPluginManager": plugins.MilesPluginManager,
             "torch": torch}
    specs = [getattr(hookspecs, n) for n in dir(hookspecs) if n.startswith("miles_")]
    assert len(specs) > 15
    for spec in specs:
        hints = typing.get_type_hints(spec, globalns=vars(hookspecs), localns=names)
        for arg in ("run", "config", "pm", "register"):
            if arg in hints:
                assert hints[arg] is not typing.Any, (spec.__name__, arg)
    assert typing.get_type_hints(hookspecs.miles_register_envs, localns=names)["register"] is P.RegisterComponent
    assert typing.get_type_hints(hookspecs.miles_register_commands, localns=names)["register"] is P.RegisterCommand
    assert typing.get_type_hints(hookspecs.miles_warm_start, localns=names)["run"] is P.RunContext


def test_the_registration_hooks_pass_a_callable_with_the_declared_signature():
    import inspect

    seen = {}

    class Spy:
        from miles import hookimpl

        @hookimpl
        def miles_register_envs(self, register):
            seen["envs"] = inspect.signature(register)

    spied = make_plugin_manager(autoload=False)
    spied.register(Spy(), name="spy")
    spied.registry("envs")
    declared = inspect.signature(P.RegisterComponent.__call__)
    assert list(seen["envs"].parameters) == [p for p in declared.parameters if p != "self"]
