import inspect

import pluggy

import miles
from miles import hookspecs
from miles.plugins import make_plugin_manager

PINNED = {
    "miles_reward": ["sample"], "miles_filter": ["group"], "miles_loss": ["batch", "logprobs"],
    "miles_rollout": ["task", "n", "engine", "env"], "miles_on_step_end": ["step", "metrics"],
    **{f"miles_register_{k}": ["register"] for k in
       ("engines", "trainers", "transports", "algorithms", "envs", "model_specs", "launchers", "loggers")},
}


def _specs():
    return {n: f for n, f in vars(hookspecs).items() if n.startswith("miles_") and callable(f)}


def test_every_pinned_hook_exists_with_its_argument_names():
    """The pinned arguments come first, in order; a spec may gain arguments after them (a hookimpl
    takes any subset, so existing plugins keep working)."""
    specs = _specs()
    for name, args in PINNED.items():
        assert name in specs, name
        assert list(inspect.signature(specs[name]).parameters)[:len(args)] == args, name


def test_every_hook_is_documented_and_typed():
    for name, fn in _specs().items():
        doc = inspect.getdoc(fn) or ""
        assert len(doc) > 40, f"{name} has no real docstring"
        assert "called" in doc.lower(), f"{name}'s docstring must say when it is called"
        sig = inspect.signature(fn)
        assert sig.return_annotation is not inspect.Signature.empty, name
        for p in sig.parameters.values():
            assert p.annotation is not inspect.Parameter.empty, f"{name}({p.name}) is untyped"


def test_firstresult_hooks_are_marked():
    opts = {n: f.miles_spec for n, f in _specs().items()}
    for name in ("miles_reward", "miles_loss", "miles_rollout"):
        assert opts[name]["firstresult"], name
    for name in ("miles_filter", "miles_on_step_end"):
        assert not opts[name]["firstresult"], name


def test_public_names():
    assert isinstance(miles.hookimpl, pluggy.HookimplMarker)
    assert miles.hookimpl.project_name == "miles"
    for n in ("Task", "Sample", "Group"):
        assert hasattr(miles, n)


def test_import_miles_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, miles, miles.cli, miles.config, miles.loop; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_fresh_manager_each_time():
    a, b = make_plugin_manager(), make_plugin_manager()
    assert a is not b
