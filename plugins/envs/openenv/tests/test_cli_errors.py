"""Bad input to the bundled game's server, run as a user runs it: one line naming the flag and the
fix, exit 2, no traceback, before openenv is imported."""
import socket
import subprocess
import sys

import pytest

SERVER = "miles_plugin_openenv.server"


@pytest.fixture(scope="module")
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("args, words", [
    (["--port", "{busy}"], ["--port {busy}: 127.0.0.1:{busy} is in use", "pass a free --port"]),
    (["--port", "70000"], ["--port 70000 is not a TCP port"]),
    (["--host", "nosuch.invalid"], ["--host nosuch.invalid: cannot be resolved", "e.g. 127.0.0.1"]),
    (["--max-sessions", "0"], ["--max-sessions 0: pass a positive number"]),
    (["--teacher-carry-accuracy", "3"], ["--teacher-carry-accuracy 3.0: pass a probability in 0..1"]),
])
def test_bad_input_is_one_line_naming_the_flag(busy_port, args, words):
    args = [a.format(busy=busy_port) for a in args]
    p = subprocess.run([sys.executable, "-m", SERVER, *args], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stdout + p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert p.stderr.startswith(f"python -m {SERVER}: error: ")
    assert all(w.format(busy=busy_port) in p.stderr for w in words), p.stderr
