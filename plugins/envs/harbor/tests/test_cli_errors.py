"""Bad input to the connector's commands: one line naming the flag (or the variable) and the fix,
exit 2, no traceback. The missing-Python test runs the launcher as a user runs it (``python -m``);
the others call the same ``main(argv)`` in this process."""
import functools
import socket

import pytest
from miles.testing import assert_usage_error, call_main, listening_port, run_module

LAUNCH = "miles_plugin_harbor.launch"
PROG = f"python -m {LAUNCH}"


@pytest.fixture
def run(capsys):
    """``run(module, *args)``: the module's ``main(args)`` in this process (``miles.testing.call_main``)."""
    return functools.partial(call_main, capsys)


@pytest.fixture
def busy_port():
    with listening_port() as port:
        yield port


def test_a_port_in_use_or_out_of_range_is_named(tmp_path, busy_port, run):
    p = run(LAUNCH, "--port", str(busy_port), "--work-dir", str(tmp_path / "w"))
    assert_usage_error(p, PROG, f"--port {busy_port}: 127.0.0.1:{busy_port} is in use", "pass a free --port")
    p = run(LAUNCH, "--port", "0", "--work-dir", str(tmp_path / "w"))
    assert_usage_error(p, PROG, "--port 0 is not a TCP port", "1..65535")


def test_a_work_dir_that_cannot_be_a_folder_is_named(tmp_path, run):
    (tmp_path / "file").write_text("")
    p = run(LAUNCH, "--work-dir", str(tmp_path / "file/w"))
    assert_usage_error(p, PROG, f"--work-dir {tmp_path / 'file/w'}: cannot create the folder")


def test_a_missing_python_for_the_venv_names_the_variable(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"HARBOR_PYTHON": str(tmp_path / "no-python3.12"), "HARBOR_VENV": str(tmp_path / "venv")}
    p = run_module(LAUNCH, "--port", str(port), "--work-dir", str(tmp_path / "w"), env=env)
    assert p.returncode == 2 and "Traceback" not in p.stdout + p.stderr, p.stderr
    assert p.stderr.startswith(f"python -m {LAUNCH}: error: ") and "make_venv.sh failed (exit 2)" in p.stderr
    assert f"no Python 3.12 at {tmp_path / 'no-python3.12'}; set HARBOR_PYTHON to one" in p.stderr


def test_the_tiny_policy_into_a_file_is_a_usage_error(tmp_path, run):
    (tmp_path / "file").write_text("")
    module = "miles_plugin_harbor.tiny_policy"
    for folder in (tmp_path / "file", tmp_path / "file/p"):
        p = run(module, str(folder))
        assert_usage_error(p, f"python -m {module}", f"cannot write the policy folder {folder}", "pass FOLDER")
    assert (tmp_path / "file").read_text() == ""
