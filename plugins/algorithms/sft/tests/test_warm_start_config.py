"""``run.warm_start`` is this plugin's schema: the kernel keeps the section as given and the
plugin's ``miles_validate_config`` reports every problem under ``run.warm_start.<key>``."""
from pathlib import Path

import pytest
from miles.config import apply_overrides, read_yaml, resolve
from miles.errors import ConfigError
from miles.plugins import make_plugin_manager
from miles_plugin_sft.warmstart import check

TINY = str(Path(__file__).resolve().parents[4] / "tests" / "tiny.yaml")


@pytest.fixture(scope="module")
def pm():
    return make_plugin_manager()


def problems(pm, *overrides):
    with pytest.raises(ConfigError) as e:
        resolve(pm, apply_overrides(read_yaml(TINY), list(overrides)))
    return e.value.problems


def test_bad_warm_start_keys_are_named_with_the_fix(pm):
    found = problems(pm, "run.warm_start.max_step=10", "run.warm_start.patience=0", "run.warm_start.algorithm=nope")
    assert any(p.startswith("run.warm_start.max_step: unknown key; allowed keys:") and "max_steps" in p
               for p in found), found
    assert any(p.startswith("run.warm_start.patience:") for p in found), found
    assert any(p.startswith("run.warm_start.algorithm: unknown algorithm 'nope'") for p in found), found


def test_the_kernel_keeps_the_section_as_given_and_the_plugin_fills_its_defaults(pm):
    cfg = resolve(pm, apply_overrides(read_yaml(TINY), ["run.warm_start.max_steps=7"]))
    assert cfg.run.warm_start == {"batch_size": 32, "eval_every": 5, "max_steps": 7, "trainer": {"lr": 3.0e-3}}
    assert check(cfg.run.warm_start, pm) == []
    from miles_plugin_sft.warmstart import settings

    ws = settings(cfg.run.warm_start, [])
    assert (ws.max_steps, ws.patience, ws.algorithm) == (7, 4, "sft")
