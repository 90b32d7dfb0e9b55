"""The eval command registers without torch and takes the arguments ``miles train`` takes. (Its end
to end run, a trained checkpoint evaluated, is ``tests/test_run.py``'s eval-and-export test.)"""
import subprocess
import sys


def test_the_command_registers_without_importing_torch():
    code = ("import sys; from miles import make_plugin_manager; from miles.cli import parser; "
            "pm = make_plugin_manager(extra=['miles_plugin_eval'], autoload=False); "
            "args = parser(pm).parse_args(['eval', 'c.yaml', 'run.steps=1', '--plugin', 'p.py']); "
            "assert (args.config, args.overrides, args.plugin) == ('c.yaml', ['run.steps=1'], ['p.py']), args; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_missing_config_is_an_error_without_a_traceback(tmp_path, capsys):
    from miles.cli import main

    assert main(["eval", str(tmp_path / "none.yaml")]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "Traceback" not in err
