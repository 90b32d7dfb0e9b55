"""Commands from plugins (hook ``miles_register_commands``) and ``miles report`` on the command line."""
import json

import pytest
from miles import PluginError, hookimpl, make_plugin_manager
from miles.cli import parser

from .conftest import run_cli


class Hello:
    @hookimpl
    def miles_register_commands(self, register):
        register("hello", "greet someone", lambda p: p.add_argument("who"), lambda args: len(args.who))


class Clash:
    @hookimpl
    def miles_register_commands(self, register):
        register("train", "a second train", lambda p: None, lambda args: 0)


def test_a_plugin_adds_a_subcommand():
    pm = make_plugin_manager(autoload=False)
    pm.register(Hello(), name="hello-plugin")
    args = parser(pm).parse_args(["hello", "world"])
    assert args.fn(args) == 5
    with pytest.raises(SystemExit):  # without the plugin there is no such command
        parser(make_plugin_manager(autoload=False)).parse_args(["hello", "world"])


def test_a_command_that_exists_already_is_an_error_naming_the_plugin():
    pm = make_plugin_manager(autoload=False)
    pm.register(Clash(), name="clash-plugin")
    with pytest.raises(PluginError, match="clash-plugin.*'train'"):
        parser(pm)


def test_miles_report_on_the_command_line(tmp_path):
    rows = [{"step": 0, "eval_accuracy": 0.2}, {"step": 1, "reward_mean": 0.5, "step_seconds": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert "report" in run_cli("--help").stdout
    r = run_cli("report", str(tmp_path), "--out", str(tmp_path / "page"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "page" / "index.html").is_file() and (tmp_path / "page" / "reward.png").is_file()
    bad = run_cli("report", str(tmp_path / "page"))  # a folder without metrics.jsonl
    assert bad.returncode == 2 and "no metrics.jsonl" in bad.stderr and "Traceback" not in bad.stderr
