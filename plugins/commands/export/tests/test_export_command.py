"""The export command registers without torch and refuses a bad run folder or target before building anything."""
import subprocess
import sys

from miles.cli import main


def test_the_command_registers_without_importing_torch():
    code = ("import sys; from miles import make_plugin_manager; from miles.cli import parser; "
            "pm = make_plugin_manager(extra=['miles_plugin_export'], autoload=False); "
            "args = parser(pm).parse_args(['export', 'RUN', '--to', 'OUT', '--force']); "
            "assert (args.run_dir, args.to, args.force) == ('RUN', 'OUT', True), args; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_folder_without_a_run_or_a_target_inside_the_checkpoints_is_refused(tmp_path, capsys):
    assert main(["export", str(tmp_path), "--to", str(tmp_path / "out")]) == 2
    assert "is not a run folder (no config.yaml)" in capsys.readouterr().err
    (tmp_path / "config.yaml").write_text("run: {steps: 1}\n")
    assert main(["export", str(tmp_path), "--to", str(tmp_path / "checkpoints" / "x")]) == 2
    assert "is the run folder" in capsys.readouterr().err
    assert main(["export", str(tmp_path), "--to", str(tmp_path / "export")]) == 2
    assert "has no intact checkpoint; train first" in capsys.readouterr().err
    assert not (tmp_path / "export").exists()
