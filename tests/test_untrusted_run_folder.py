"""Opening a shared run folder runs none of its code: the plugins its config.yaml lists are imported
by ``miles export``/``eval``/``report`` only when named with ``--plugin`` or trusted with
``--trust-run-plugins``, and the commands say which ones they left out."""
from __future__ import annotations

from pathlib import Path

import pytest
from miles.cli import main

ROOT = Path(__file__).resolve().parents[1]
# a launch-time plugin that leaves a mark when imported (a planted one would do worse)
PLANT = """
from pathlib import Path
Path(__file__).with_name("imported").write_text("ran")
"""


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """A trained one-step run whose config.yaml lists a launch-time plugin file."""
    base = tmp_path_factory.mktemp("shared")
    plant = base / "plant.py"
    plant.write_text(PLANT)
    cfg = base / "run.yaml"
    cfg.write_text((ROOT / "tests" / "tiny.yaml").read_text() + f"plugins: [{plant}]\n")
    out = base / "run"
    assert main(["train", str(cfg), f"run.out_dir={out}", "run.steps=1", "run.checkpoint_every=1",
                 "run.eval_every=1", "run.warm_start=null", "run.threads=1"]) == 0
    (base / "imported").unlink()  # training imported it, as it should
    return base, out, plant


def test_export_and_eval_skip_the_folders_plugins_and_name_them(shared, capfd):
    base, out, plant = shared
    capfd.readouterr()
    assert main(["export", str(out), "--to", str(base / "hf")]) == 0
    err = capfd.readouterr().err
    assert f"not importing the plugins {out / 'config.yaml'} lists ({plant})" in err
    assert "--trust-run-plugins" in err and (base / "hf" / "config.json").is_file()
    assert main(["eval", str(out / "config.yaml"), "rollout.batch_size=4", "env.eval_size=4"]) == 0
    assert str(plant) in capfd.readouterr().err
    assert not (base / "imported").exists()
    assert main(["report", str(out), "--out", str(base / "report")]) == 0
    assert not (base / "imported").exists()


@pytest.mark.parametrize("opt_in", [["--plugin", "PLANT"], ["--trust-run-plugins"]])
def test_a_plugin_named_on_the_command_line_or_a_trusted_folder_is_imported(shared, capfd, opt_in):
    base, out, plant = shared
    opt_in = [str(plant) if a == "PLANT" else a for a in opt_in]
    to = base / f"hf-{opt_in[0]}"
    try:
        assert main(["export", str(out), "--to", str(to), *opt_in]) == 0
        assert (base / "imported").exists()  # the test above would see an import
        assert "not importing" not in capfd.readouterr().err
    finally:
        (base / "imported").unlink(missing_ok=True)


def test_a_recipe_outside_a_run_folder_keeps_its_plugins(shared, tmp_path):
    from miles.runfolder import is_run_config

    base, out, _ = shared
    assert is_run_config(out / "config.yaml") and not is_run_config(base / "run.yaml")
    lone = tmp_path / "config.yaml"  # a config.yaml with no run beside it is a recipe
    lone.write_text("run: {steps: 1}\n")
    assert not is_run_config(lone)
