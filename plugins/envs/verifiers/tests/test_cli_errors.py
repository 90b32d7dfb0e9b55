"""Bad input to the connector's commands (the policy folder writer, the worker in verifiers' own
virtualenv): one line naming the argument and the fix, exit 2, no traceback. The worker and the
writer's first case run as a user runs them; the writer's other cases call the same ``main(argv)``
in this process."""
import socket
import subprocess
from pathlib import Path

import pytest
from miles.testing import assert_usage_error, listening_port, run_module

PLUGIN = Path(__file__).resolve().parents[1]
RECIPE = str(PLUGIN.parents[2] / "recipes/verifiers.yaml")
POLICY = "miles_plugin_verifiers.policy"


@pytest.fixture(scope="module")
def busy_port():
    with listening_port() as port:
        yield port


@pytest.fixture
def policy(capsys):
    """``policy(*args)``: the writer's ``main(args)`` in this process, its exit code and captured
    output as a CompletedProcess."""
    from miles_plugin_verifiers.policy import main

    def call(*args: str) -> subprocess.CompletedProcess:
        capsys.readouterr()
        code = main(list(args))
        out = capsys.readouterr()
        return subprocess.CompletedProcess([POLICY, *args], code, out.out, out.err)

    return call


def test_the_policy_writer_names_a_missing_recipe_a_bad_key_and_an_unwritable_folder(tmp_path, policy):
    out = tmp_path / "m"
    assert_usage_error(run_module(POLICY, str(tmp_path / "nope.yaml"), str(out)), f"python -m {POLICY}",
                       f"file {tmp_path / 'nope.yaml'} does not exist")
    assert_usage_error(policy(RECIPE, str(out), "model.hidden=8"), f"python -m {POLICY}",
                       "model.hidden: unknown key; allowed keys:")
    assert_usage_error(policy(RECIPE, str(out), "model.name=nosuch"), f"python -m {POLICY}",
                       "model.name: unknown model spec 'nosuch'")
    assert not out.exists()  # nothing written for a recipe that does not validate
    (tmp_path / "file").write_text("")
    assert_usage_error(policy(RECIPE, str(tmp_path / "file/m")), f"python -m {POLICY}",
                       f"OUT {tmp_path / 'file/m'}: cannot create the folder", "pass a folder path")


@pytest.mark.parametrize("args, words", [
    (["--port", "{busy}"], ["--port {busy}: 127.0.0.1:{busy} is in use", "pass a free --port"]),
    (["--port", "0"], ["--port 0 is not a TCP port"]),
    (["--max-tasks", "0"], ["--max-tasks 0: pass a positive number"]),
    (["--taskset", "no_such_taskset", "--port", "{free}"], ["--taskset 'no_such_taskset':", "not found"]),
])
def test_the_worker_names_the_flag(vf_python, busy_port, args, words):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    args = [a.format(busy=busy_port, free=free) for a in args]
    p = subprocess.run([vf_python, str(PLUGIN / "worker/server.py"), *args], capture_output=True, text=True,
                       timeout=300)
    assert_usage_error(p, "server.py", *[w.format(busy=busy_port) for w in words])
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
