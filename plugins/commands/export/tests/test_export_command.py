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


def test_compressed_tensors_is_for_int4_qat_runs(tmp_path):
    import pytest
    from miles import MilesError
    from miles_plugin_export.command import _compress

    class Trainer:  # a trainer rounding its weights to fp8 (miles.protocols.SendsPacked)
        packed_formats = {"model.layers.0.mlp.up_proj.weight": "fp8"}

        def packed_weights(self):
            return iter(())

        def served_weights(self, named):
            return iter(named)

    assert _compress(Trainer(), tmp_path, "auto") == 0  # auto: such a folder stays dense
    with pytest.raises(MilesError, match="trainer.qat: int4 run; this run's trainer rounds its weights to fp8: "
                                         "pass --format dense"):
        _compress(Trainer(), tmp_path, "compressed-tensors")
    Trainer.packed_formats = {}
    with pytest.raises(MilesError, match="rounds no weights"):
        _compress(Trainer(), tmp_path, "compressed-tensors")
