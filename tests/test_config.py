"""Config errors: every problem at once, naming the key and what is allowed; clean CLI exits."""
import pytest

from miles.config import apply_overrides, read_yaml, resolve
from miles.errors import ConfigError
from miles.plugins import make_plugin_manager

TINY = "tests/tiny.yaml"


@pytest.fixture(scope="module")
def pm():
    return make_plugin_manager()


def _problems(pm, data):
    with pytest.raises(ConfigError) as e:
        resolve(pm, data)
    return e.value.problems


def test_valid_config_resolves_to_typed_sections(pm):
    cfg = resolve(pm, apply_overrides(read_yaml(TINY), ["run.steps=3", "algorithm.clip_low=0.1"]))
    assert cfg.run.steps == 3
    assert cfg.name("algorithm") == "grpo" and cfg.settings("algorithm").clip_low == 0.1
    assert cfg.name("trainer") == "fsdp2" and cfg.settings("trainer").lr == 1e-3


def test_all_problems_reported_at_once(pm):
    data = apply_overrides(read_yaml(TINY), ["run.stepz=3", "rollout.n=zero", "algorithm.clip_lo=1",
                                             "engine.name=warp", "bogus.x=1"])
    problems = "\n".join(_problems(pm, data))
    assert "run.stepz: unknown key; allowed keys:" in problems and "steps" in problems
    assert "rollout.n:" in problems and "'zero'" in problems
    assert "algorithm.clip_lo: unknown key" in problems and "clip_low" in problems
    assert "engine.name: unknown engine 'warp'; registered: " in problems and "sglang, torch" in problems
    assert "bogus: unknown section" in problems


def test_component_schema_checks_values(pm):
    problems = _problems(pm, apply_overrides(read_yaml(TINY), ["algorithm.clip_high=0.1", "trainer.lr=-1"]))
    assert any(p.startswith("algorithm") and "clip_high" in p for p in problems)
    assert any(p.startswith("trainer.lr") for p in problems)


def test_missing_file_and_broken_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        read_yaml(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: {steps: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        read_yaml(str(bad))


@pytest.mark.parametrize("args,needle", [
    (["train", TINY, "run.stepz=1"], "run.stepz: unknown key"),
    (["train", TINY, "rollout.temperature=hot"], "rollout.temperature"),
    (["train", "tests/missing.yaml"], "does not exist"),
    (["train", TINY, "env.name=chess"], "unknown env 'chess'"),
    (["train", TINY, "--plugin", "tests/nonexistent_plugin.py"], "nonexistent_plugin.py does not exist"),
])
def test_cli_errors_are_clean(cli, args, needle):
    r = cli(*args)
    assert r.returncode == 2
    assert needle in r.stderr
    assert "Traceback" not in r.stderr + r.stdout


def test_cli_broken_yaml_and_failing_plugin(cli, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run:\n  steps: [\n")
    r = cli("train", str(bad))
    assert r.returncode == 2 and "not valid YAML" in r.stderr and "Traceback" not in r.stderr
    plug = tmp_path / "explodes.py"
    plug.write_text("import nonexistent_module_xyz\n")
    r = cli("train", TINY, "--plugin", str(plug))
    assert r.returncode == 2 and "explodes.py failed to import" in r.stderr
    assert "nonexistent_module_xyz" in r.stderr and "Traceback" not in r.stderr


def test_rollout_in_flight(pm, cli, tmp_path):
    """An async-only key is owned by the async mode's schema: checked there, and named as its
    setting when the run is sync."""
    bad = "\n".join(_problems(pm, apply_overrides(read_yaml(TINY), ["rollout.in_flight=abort", "run.mode=async"])))
    assert "rollout.in_flight:" in bad and "'finish' or 'resume'" in bad and "'abort'" in bad
    (sync,) = _problems(pm, apply_overrides(read_yaml(TINY), ["rollout.in_flight=resume"]))
    assert sync.startswith("rollout.in_flight: unknown key") and "setting of run.mode async" in sync
    cfg = resolve(pm, apply_overrides(read_yaml(TINY), ["rollout.in_flight=resume", "run.mode=async",
                                                          "engine.name=sglang", "engine.urls=[http://127.0.0.1:1]"]))
    assert cfg.mode_settings.in_flight == "resume"
    # the engine inside the trainer's process cannot abort and resume: an error before any training
    r = cli("train", TINY, f"run.out_dir={tmp_path}", "run.mode=async", "rollout.in_flight=resume")
    assert r.returncode == 2 and "rollout.in_flight: resume needs engines in their own processes" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "metrics.jsonl").exists()


def test_run_mode_is_one_of_the_registered_modes(pm):
    assert resolve(pm, apply_overrides(read_yaml(TINY), ["run.mode=async"])).run.mode == "async"
    assert _problems(pm, apply_overrides(read_yaml(TINY), ["run.mode=overlap"])) == [
        "run.mode: unknown mode 'overlap'; registered: async, sync (install or --plugin the plugin "
        "that provides it)"]
    # async is the miles-plugin-async distribution's: without it, the error says what to install
    bare = make_plugin_manager(extra=["miles_plugin_hf", "miles_plugin_arith", "miles_plugin_grpo",
                                      "miles_plugin_torch_engine", "miles_plugin_fsdp2",
                                      "miles_plugin_tensor", "miles_plugin_sft"], autoload=False)
    assert resolve(bare, read_yaml(TINY)).run.mode == "sync"
    assert _problems(bare, apply_overrides(read_yaml(TINY), ["run.mode=async"])) == [
        "run.mode: unknown mode 'async'; registered: sync (pip install miles-plugin-async, which "
        "provides it)"]


def test_the_kernel_ships_the_default_mode_and_rollout_and_a_missing_warm_start_says_what_to_install():
    base = ["miles_plugin_hf", "miles_plugin_arith", "miles_plugin_grpo", "miles_plugin_torch_engine",
            "miles_plugin_fsdp2", "miles_plugin_tensor"]
    problems = _problems(make_plugin_manager(extra=base, autoload=False), read_yaml(TINY))
    text = "\n".join(problems)
    assert not any(p.startswith(("run.mode", "rollout.name")) for p in problems), text
    assert any(p.startswith("run.warm_start: no installed plugin runs a warm start") for p in problems), text
    # the warm start's trainer settings over the trainer section, checked by the sft plugin's hook
    full = make_plugin_manager(extra=base + ["miles_plugin_sft"],
                               autoload=False)
    assert resolve(full, read_yaml(TINY)).run.warm_start["trainer"] == {"lr": 3.0e-3}
    bad = _problems(full, apply_overrides(read_yaml(TINY), ["run.warm_start.trainer.lr=-1"]))
    assert len(bad) == 1 and bad[0].startswith("run.warm_start.trainer.lr:"), bad


def test_sync_is_an_alias_of_the_transport_section(pm, capsys):
    import miles.config as config

    config._NOTICED.clear()
    data = read_yaml(TINY)
    data["sync"] = data.pop("transport", {"name": "tensor"})
    cfg = resolve(pm, apply_overrides(data, ["sync.name=disk", "sync.verify=true"]))
    assert cfg.name("transport") == "disk" and cfg.settings("transport").verify is True
    assert "sync" not in cfg.resolved() and cfg.resolved()["transport"]["name"] == "disk"
    err = capsys.readouterr().err
    assert err.count("note: the sync: section is now spelled transport:") == 1, err
    # an override under the new spelling wins over the file's old one
    cfg = resolve(pm, apply_overrides({**read_yaml(TINY), "sync": {"name": "disk"}}, ["transport.name=tensor"]))
    assert cfg.name("transport") == "tensor"
    clash = _problems(pm, {**read_yaml(TINY), "transport": {"name": "tensor"}, "sync": {"name": "disk"}})
    assert clash == ["sync.name: differs from transport.name; set it once, under transport:"]
