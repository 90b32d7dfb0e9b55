"""Config input that used to give silently wrong runs or tracebacks: strict types, duplicate YAML
keys, overrides that threw a section away, nesting and alias bombs, impossible sizes, odd files as
configs or plugins, and plugins that misbehave while loading or validating. Every case exits 2 with
one message naming the cause, and writes nothing."""
from __future__ import annotations

import textwrap
import time
from pathlib import Path

from miles.cli import main
from miles.config import read_yaml

TINY = str(Path(__file__).resolve().parent / "tiny.yaml")


def miles(capfd, *argv: str) -> tuple[int, str]:
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    out, err = capfd.readouterr()
    return code, out + err


def refused(capfd, tmp_path: Path, *argv: str, config: str = TINY) -> str:
    """``miles train`` on ``argv``: exit 2, no traceback, no run folder; the message."""
    out = tmp_path / "run"
    code, text = miles(capfd, "train", config, f"run.out_dir={out}", *argv)
    assert code == 2, text
    assert "Traceback" not in text and "miles: error:" in text, text
    assert not out.exists()
    return text


def test_a_bool_is_no_number(capfd, tmp_path):
    assert "run.steps: Input should be a valid integer (got True)" in refused(capfd, tmp_path, "run.steps=true")
    assert "rollout.n" in refused(capfd, tmp_path, "rollout.n=1e9")  # a float is no count either
    assert "env.digits" in refused(capfd, tmp_path, "env.digits=yes")  # component schemas too


def test_yaml_12_floats_are_numbers(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("trainer: {lr: 1e-3, wd: 2E+2}\n")
    assert read_yaml(str(f)) == {"trainer": {"lr": 0.001, "wd": 200.0}}


def test_duplicate_yaml_keys_are_refused_and_merge_keys_still_work(capfd, tmp_path):
    cfg = tmp_path / "dup.yaml"
    cfg.write_text(Path(TINY).read_text() + "run:\n  steps: 2\n")
    text = refused(capfd, tmp_path, config=str(cfg))
    line = len(Path(TINY).read_text().splitlines()) + 1
    assert f"line {line}: duplicate key 'run' (first at line" in text, text
    merged = tmp_path / "merge.yaml"
    merged.write_text("base: &b {steps: 2, seed: 1}\nrun:\n  <<: *b\n  steps: 3\n")
    assert read_yaml(str(merged))["run"] == {"steps": 3, "seed": 1}


def test_an_override_under_a_scalar_is_refused_and_nothing_is_written(capfd, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, text = miles(capfd, "train", TINY, "run=5", "run.steps=1")
    assert code == 2 and "run.steps: run is 5, not a mapping" in text, text
    assert list(tmp_path.iterdir()) == []  # no ./runs/default


def test_deep_nesting_and_alias_bombs_are_refused_quickly(capfd, tmp_path):
    deep = tmp_path / "deep.yaml"
    deep.write_text("run:\n  x: " + "[" * 5000 + "]" * 5000 + "\n")
    assert "nested more than 64 levels" in refused(capfd, tmp_path, config=str(deep))
    bomb = tmp_path / "bomb.yaml"
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i, name in enumerate("bcdefghi"):
        prev = "abcdefgh"[i]
        lines.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    bomb.write_text("\n".join(lines) + "\n")
    assert len(bomb.read_bytes()) < 400
    t0 = time.perf_counter()
    text = refused(capfd, tmp_path, config=str(bomb))
    assert time.perf_counter() - t0 < 10 and len(text) < 2000, len(text)
    assert "through its aliases" in text
    assert "nested more than 64 levels" in refused(capfd, tmp_path, "plugins=" + "[" * 100 + "]" * 100)


def test_impossible_sizes_and_seeds_are_refused_before_anything_is_built(capfd, tmp_path):
    text = refused(capfd, tmp_path, "rollout.n=1000000000")
    assert "GiB of memory" in text and "lower rollout.batch_size, rollout.n" in text, text
    assert "run.seed: Input should be less than 4294967296" in refused(capfd, tmp_path, f"run.seed={10**23}")


def test_devices_and_folders_are_no_configs_or_plugins(capfd, tmp_path):
    assert "/dev/zero is not a regular file" in refused(capfd, tmp_path, config="/dev/zero")
    assert "is a folder" in refused(capfd, tmp_path, config=str(tmp_path))
    assert "/dev/zero is not a regular file" in refused(capfd, tmp_path, "--plugin", "/dev/zero")
    (tmp_path / "pkg").mkdir()
    assert "is a folder" in refused(capfd, tmp_path, "--plugin", str(tmp_path / "pkg") + "/")


def plugin(tmp_path: Path, body: str) -> str:
    path = tmp_path / f"p{abs(hash(body)) % 10**8}.py"
    path.write_text("from miles import hookimpl\n" + textwrap.dedent(body))
    return str(path)


def test_plugins_that_exit_or_register_junk_are_named(capfd, tmp_path):
    exits = plugin(tmp_path, "import sys\nsys.exit(3)\n")
    text = refused(capfd, tmp_path, "--plugin", exits)
    assert exits in text and "SystemExit" in text, text
    junk = plugin(tmp_path, """
        @hookimpl
        def miles_register_loggers(register):
            register("junk", 5)
    """)
    text = refused(capfd, tmp_path, "--plugin", junk)
    assert "factory that is not callable" in text and junk in text, text


def test_a_string_from_validate_config_is_one_problem(capfd, tmp_path):
    one = plugin(tmp_path, """
        @hookimpl
        def miles_validate_config(config):
            return "trainer.lr: too high for this model"
    """)
    text = refused(capfd, tmp_path, "--plugin", one)
    assert "1 problem(s)" in text and "- trainer.lr: too high for this model" in text, text
    odd = plugin(tmp_path, """
        @hookimpl
        def miles_validate_config(config):
            return 5
    """)
    text = refused(capfd, tmp_path, "--plugin", odd)
    assert f"miles_validate_config of plugin {odd} returned int 5" in text, text


def test_a_hook_without_hookimpl_is_warned_about(capfd, tmp_path):
    bare = plugin(tmp_path, """
        def miles_reward(sample):
            return 1.0
    """)
    text = refused(capfd, tmp_path, "--plugin", bare, "run.steps=true")
    assert f"plugin {bare} defines miles_reward without @hookimpl" in text, text


def test_a_logger_factory_that_raises_is_named(capfd, tmp_path):
    broken = plugin(tmp_path, """
        def boom(cfg, **kw):
            raise RuntimeError("no dashboard server")

        @hookimpl
        def miles_register_loggers(register):
            register("boom", boom)
    """)
    run = tmp_path / "run"
    code, text = miles(capfd, "train", TINY, f"run.out_dir={run}", "run.warm_start=null", "run.steps=1",
                       "loggers=[boom]", "--plugin", broken)
    assert code == 2 and "logger 'boom'" in text and "no dashboard server" in text, text
    assert "Traceback" not in text and not run.exists()



def _launch_cases() -> list[tuple[list[str], str]]:
    import torch

    cases = [(["launcher.name=local", "launcher.engines=0", "launcher.trainer_ranks=1", "trainer.world_size=2"],
              "trainer.world_size: 2, but launcher.trainer_ranks starts 1"),
             (["launcher.name=local", "launcher.host=0.0.0.0"], "keep 127.0.0.1"),
             (["sync.name=p2p"], "transport.name: p2p writes into engine processes")]
    if not torch.cuda.is_available():
        cases.append((["trainer.name=megatron"], "torch sees no CUDA GPU here"))
    return cases


def test_runs_a_launch_would_reject_are_refused_before_anything_is_written(capfd, tmp_path):
    for overrides, said in _launch_cases():
        text = refused(capfd, tmp_path, "run.warm_start=null", *overrides)
        assert said in text, (overrides, text)
