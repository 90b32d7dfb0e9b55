"""Bad input to the connector's commands: one line naming the flag and the fix, exit 2, no
traceback, and nothing slow (the NeMo Gym venv) started first. The first test runs the launcher as a
user runs it (``python -m``); the others call the same ``main(argv)`` in this process."""
import functools
import socket

import pytest
from miles.testing import assert_usage_error, call_main, listening_port, run_module


@pytest.fixture
def busy_port():
    with listening_port() as port:
        yield port


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LAUNCH = "miles_plugin_nemo_gym.launch"
PROG = f"python -m {LAUNCH}"


@pytest.fixture
def run(capsys):
    """``run(module, *args)``: the module's ``main(args)`` in this process (``miles.testing.call_main``)."""
    return functools.partial(call_main, capsys)


def test_a_policy_url_with_nothing_behind_it_fails_before_the_venv_is_built(tmp_path):
    # a venv build that would fail at once: the URL's error must come first
    env = {"NEMO_GYM_PYTHON": str(tmp_path / "no-python"), "NEMO_GYM_VENV": str(tmp_path / "venv")}
    url = f"http://127.0.0.1:{closed_port()}/v1"
    p = run_module(LAUNCH, "--policy-url", url, "--work-dir", str(tmp_path / "w"), "--wait-policy", "0", env=env)
    assert_usage_error(p, PROG, f"no model listed at {url}/models", "is miles serve running there?",
                       "--policy-url")
    assert not (tmp_path / "venv").exists()


def test_the_launcher_waits_for_a_policy_server_that_starts_later(tmp_path, run):
    """The README starts miles serve and the launcher together: a server that comes up a few
    seconds later is waited for (up to --wait-policy), one that never does is named after it."""
    import http.server
    import json
    import threading
    import time

    from miles_plugin_nemo_gym.launch import served_model

    port = closed_port()

    class Models(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"data": [{"id": "late-policy"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    def serve_later():
        time.sleep(2.0)
        server = http.server.HTTPServer(("127.0.0.1", port), Models)
        threading.Thread(target=server.serve_forever, daemon=True).start()

    threading.Thread(target=serve_later, daemon=True).start()
    t0 = time.monotonic()
    assert served_model(f"http://127.0.0.1:{port}/v1", "none", wait_s=30) == "late-policy"
    assert 1.5 < time.monotonic() - t0 < 20
    p = run(LAUNCH, "--policy-url", f"http://127.0.0.1:{closed_port()}/v1", "--work-dir", str(tmp_path / "w"),
            "--wait-policy", "2")
    assert_usage_error(p, PROG, "after waiting 2 s (--wait-policy)", "is miles serve running there?")
    assert "waiting up to 2 s for miles serve" in p.stderr


@pytest.mark.parametrize("url", ["127.0.0.1:30000/v1", "http://[::1/v1", "http://127.0.0.1:99999/v1"])
def test_a_policy_url_that_is_no_url_is_named(tmp_path, url, run):
    p = run(LAUNCH, "--policy-url", url, "--work-dir", str(tmp_path / "w"))
    assert_usage_error(p, PROG, f"--policy-url {url!r} is not an http(s) URL", "http://127.0.0.1:30000/v1")


def test_a_port_in_use_is_named(tmp_path, busy_port, run):
    url = f"http://127.0.0.1:{closed_port()}/v1"
    p = run(LAUNCH, "--policy-url", url, "--agent-port", str(busy_port), "--work-dir", str(tmp_path / "w"))
    assert_usage_error(p, PROG, f"--agent-port {busy_port}: 127.0.0.1:{busy_port} is in use",
                       "pass a free --agent-port")
    p = run(LAUNCH, "--policy-url", url, "--head-port", "70000", "--work-dir", str(tmp_path / "w"))
    assert_usage_error(p, PROG, "--head-port 70000 is not a TCP port")
    p = run(LAUNCH, "--policy-url", url, "--head-port", "9100", "--agent-port", "9100")
    assert_usage_error(p, PROG, "--agent-port and --head-port are both 9100")


def test_a_work_dir_that_cannot_be_a_folder_is_named(tmp_path, run):
    (tmp_path / "file").write_text("")
    p = run(LAUNCH, "--policy-url", f"http://127.0.0.1:{closed_port()}/v1", "--work-dir", str(tmp_path / "file/w"))
    assert_usage_error(p, PROG, f"--work-dir {tmp_path / 'file/w'}: cannot create the folder")


def test_the_tiny_policy_into_a_file_is_a_usage_error(tmp_path, run):
    (tmp_path / "file").write_text("")
    module = "miles_plugin_nemo_gym.tiny_policy"
    for folder in (tmp_path / "file", tmp_path / "file/p"):
        p = run(module, str(folder))
        assert_usage_error(p, f"python -m {module}", f"cannot write the policy folder {folder}", "pass FOLDER")
    assert (tmp_path / "file").read_text() == ""
