import subprocess
import sys
import time

from miles_procs import session_pids, stop_session

# a leader that ignores SIGINT and leaves a grandchild behind in its session
LEADER = """
import signal, subprocess, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("ready", flush=True)
time.sleep(600)
"""


def test_stop_session_leaves_nothing_of_the_session():
    proc = subprocess.Popen([sys.executable, "-c", LEADER], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stdout.readline().strip() == "ready"
    sid = proc.pid
    deadline = time.time() + 10
    while len(session_pids(sid)) < 2 and time.time() < deadline:
        time.sleep(0.05)
    assert len(session_pids(sid)) == 2  # the leader and its child
    stop_session(proc, grace_s=0.5)  # SIGINT is ignored: the kill must do it
    assert proc.returncode is not None
    assert session_pids(sid) == []


# a server that stops its own child cleanly on SIGINT, taking a moment, and says so in a file
SERVER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
try:
    time.sleep(600)
except KeyboardInterrupt:
    child.terminate()
    child.wait()
    time.sleep(1.0)
    open(sys.argv[1], "w").write("clean")
"""
# a launcher as the connectors' are, started as a shell's background job is: SIGINT ignored
LAUNCHER = """
import subprocess, sys
from miles_procs import default_sigint, serve_until_stopped, stop_session
proc = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], start_new_session=True,
                        preexec_fn=default_sigint)
serve_until_stopped(lambda: f"up {proc.pid}", lambda: proc.poll() is None, lambda: stop_session(proc, 20))
"""


def test_a_launcher_killed_twice_stops_its_server_cleanly(tmp_path):
    import signal

    marker = tmp_path / "stopped"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, SERVER, str(marker)], stdout=subprocess.PIPE,
                                text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    line = launcher.stdout.readline().split()
    assert line[0] == "up", line
    sid = int(line[1])
    deadline = time.time() + 10
    while len(session_pids(sid)) < 2 and time.time() < deadline:
        time.sleep(0.05)
    launcher.send_signal(signal.SIGTERM)
    time.sleep(0.5)  # the server is still stopping: this second kill must not cut the stop short
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(30) == 0
    # the server got a SIGINT it could act on (not ignored as the launcher's own), and nothing is left
    assert marker.read_text() == "clean"
    assert session_pids(sid) == []
