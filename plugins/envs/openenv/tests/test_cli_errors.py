"""Bad input to the bundled game's server, run as a user runs it: one line naming the flag and the
fix, exit 2, no traceback, before openenv is imported."""

import pytest
from miles.testing import assert_usage_error, listening_port, run_module

SERVER = "miles_plugin_openenv.server"


@pytest.fixture(scope="module")
def busy_port():
    with listening_port() as port:
        yield port


@pytest.mark.parametrize("args, words", [
    (["--port", "{busy}"], ["--port {busy}: 127.0.0.1:{busy} is in use", "pass a free --port"]),
    (["--port", "70000"], ["--port 70000 is not a TCP port"]),
    (["--host", "nosuch.invalid"], ["--host nosuch.invalid: cannot be resolved", "e.g. 127.0.0.1"]),
    (["--max-sessions", "0"], ["--max-sessions 0: pass a positive number"]),
    (["--teacher-carry-accuracy", "3"], ["--teacher-carry-accuracy 3.0: pass a probability in 0..1"]),
])
def test_bad_input_is_one_line_naming_the_flag(busy_port, args, words):
    args = [a.format(busy=busy_port) for a in args]
    p = run_module(SERVER, *args, timeout=120)
    assert_usage_error(p, f"python -m {SERVER}", *(w.format(busy=busy_port) for w in words))
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
