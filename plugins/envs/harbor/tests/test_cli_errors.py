"""Bad input to the connector's commands, run as a user runs them: one line naming the flag (or
the variable) and the fix, exit 2, no traceback."""
import os
import socket
import subprocess
import sys

import pytest

LAUNCH = "miles_plugin_harbor.launch"


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def run(module: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def assert_usage_error(p: subprocess.CompletedProcess, module: str, *words: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stdout + p.stderr, p.stderr
    line = p.stderr.strip().splitlines()[-1]
    assert line.startswith(f"python -m {module}: error: "), p.stderr
    assert all(w in line for w in words), (words, line)


def test_a_port_in_use_or_out_of_range_is_named(tmp_path, busy_port):
    p = run(LAUNCH, "--port", str(busy_port), "--work-dir", str(tmp_path / "w"))
    assert_usage_error(p, LAUNCH, f"--port {busy_port}: 127.0.0.1:{busy_port} is in use", "pass a free --port")
    p = run(LAUNCH, "--port", "0", "--work-dir", str(tmp_path / "w"))
    assert_usage_error(p, LAUNCH, "--port 0 is not a TCP port", "1..65535")


def test_a_work_dir_that_cannot_be_a_folder_is_named(tmp_path):
    (tmp_path / "file").write_text("")
    p = run(LAUNCH, "--work-dir", str(tmp_path / "file/w"))
    assert_usage_error(p, LAUNCH, f"--work-dir {tmp_path / 'file/w'}: cannot create the folder")


def test_a_missing_python_for_the_venv_names_the_variable(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"HARBOR_PYTHON": str(tmp_path / "no-python3.12"), "HARBOR_VENV": str(tmp_path / "venv")}
    p = run(LAUNCH, "--port", str(port), "--work-dir", str(tmp_path / "w"), env=env)
    assert p.returncode == 2 and "Traceback" not in p.stdout + p.stderr, p.stderr
    assert p.stderr.startswith(f"python -m {LAUNCH}: error: ") and "make_venv.sh failed (exit 2)" in p.stderr
    assert f"no Python 3.12 at {tmp_path / 'no-python3.12'}; set HARBOR_PYTHON to one" in p.stderr


def test_the_tiny_policy_into_a_file_is_a_usage_error(tmp_path):
    (tmp_path / "file").write_text("")
    module = "miles_plugin_harbor.tiny_policy"
    for folder in (tmp_path / "file", tmp_path / "file/p"):
        p = run(module, str(folder))
        assert_usage_error(p, module, f"cannot write the policy folder {folder}", "pass FOLDER")
    assert (tmp_path / "file").read_text() == ""
