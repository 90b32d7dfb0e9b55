"""The serve command registers without torch, and its API key comes from the flag, a file or the environment."""
import subprocess
import sys

import pytest
from miles import MilesError, make_plugin_manager
from miles.cli import parser
from miles_procs import api_key


def _args(*argv):
    return parser(make_plugin_manager()).parse_args(["serve", "MODEL", "--port", "0", *argv])


def test_the_command_registers_without_importing_torch():
    code = ("import sys; from miles import make_plugin_manager; from miles.cli import parser; "
            "pm = make_plugin_manager(extra=['miles_plugin_serve'], autoload=False); "
            "args = parser(pm).parse_args(['serve', 'M', '--port', '7']); "
            "assert (args.model_dir, args.port) == ('M', 7), args; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_key_comes_from_flag_file_or_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("MILES_API_KEY", raising=False)
    assert api_key(_args()) is None
    monkeypatch.setenv("MILES_API_KEY", " from-env ")
    assert api_key(_args()) == "from-env"
    (tmp_path / "key").write_text("from-file\n")
    assert api_key(_args("--api-key-file", str(tmp_path / "key"))) == "from-file"
    assert api_key(_args("--api-key", "flag", "--api-key-file", str(tmp_path / "key"))) == "flag"
    (tmp_path / "empty").write_text("  \n")
    with pytest.raises(MilesError, match="is empty"):
        api_key(_args("--api-key-file", str(tmp_path / "empty")))


def test_a_blank_key_is_refused(monkeypatch):
    monkeypatch.delenv("MILES_API_KEY", raising=False)
    for blank in (" ", "", "\t"):
        with pytest.raises(MilesError, match="--api-key is blank"):
            api_key(_args("--api-key", blank))
