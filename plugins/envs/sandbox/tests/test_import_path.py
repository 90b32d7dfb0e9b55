"""The pinned import path: ``from miles_plugin_sandbox import run_python, run_shell`` gives the
sandbox library's own functions (their behaviour is tested in ``libs/sandbox/tests``)."""
import miles_sandbox
from miles_plugin_sandbox import run_python, run_shell


def test_the_plugin_re_exports_the_library_and_runs_code():
    assert run_python is miles_sandbox.run_python and run_shell is miles_sandbox.run_shell
    r = run_python("print(6 * 7)", timeout_s=20)
    assert (r.stdout, r.returncode, r.timed_out) == ("42\n", 0, False)
