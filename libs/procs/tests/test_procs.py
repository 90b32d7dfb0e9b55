import signal
import subprocess
import sys
import time

import pytest
from miles import MilesError
from miles_procs import ServerExited, serve_until_stopped, session_pids, stop_session, wait_until_ready

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
    open(sys.argv[1] + ".up", "w").close()  # serving: a SIGINT from here on is a clean stop
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
from miles import MilesError
from miles_procs import default_sigint, serve_until_stopped, stop_session
proc = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], start_new_session=True,
                        preexec_fn=default_sigint)
try:
    serve_until_stopped(lambda: f"up {proc.pid}", proc.poll, lambda: stop_session(proc, 20), "the test server",
                        sys.argv[3] if len(sys.argv) > 3 else None)
except MilesError as e:
    print(f"launcher: error: {e}", file=sys.stderr)
    sys.exit(e.exit_code)
"""


def test_a_launcher_killed_twice_stops_its_server_cleanly(tmp_path):
    marker = tmp_path / "stopped"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, SERVER, str(marker)], stdout=subprocess.PIPE,
                                text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    line = launcher.stdout.readline().split()
    assert line[0] == "up", line
    sid = int(line[1])
    up = tmp_path / "stopped.up"  # the server past its start-up, which a stop may cut short under load
    deadline = time.time() + 30
    while not (up.exists() and len(session_pids(sid)) >= 2) and time.time() < deadline:
        time.sleep(0.05)
    launcher.send_signal(signal.SIGTERM)
    time.sleep(0.5)  # the server is still stopping: this second kill must not cut the stop short
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(30) == 0
    # the server got a SIGINT it could act on (not ignored as the launcher's own), and nothing is left
    assert marker.read_text() == "clean"
    assert session_pids(sid) == []


# a server that comes up, leaves a child in its session, then exits 3 without being asked to
CRASHING = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
time.sleep(1.5)
sys.exit(3)
"""


def test_a_server_that_exits_by_itself_fails_the_launcher_naming_it(tmp_path):
    log = tmp_path / "server.log"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, CRASHING, "unused", str(log)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = launcher.communicate(timeout=60)
    sid = int(out.split()[1])
    # not a clean stop: exit 1 (the input was fine), one line with the server, its code and its log
    assert launcher.returncode == 1, (launcher.returncode, out, err)
    assert err.strip().splitlines() == [f"launcher: error: the test server exited on its own with code 3; "
                                        f"its log: {log}"], err
    assert session_pids(sid) == []  # what the server left in its session is stopped all the same


def test_a_server_killed_by_a_signal_is_named_with_the_signal():
    proc = subprocess.Popen([sys.executable, "-c", "import os, signal, time; time.sleep(0.5); "
                             "os.kill(os.getpid(), signal.SIGKILL)"], start_new_session=True)
    stops = []

    def stop():
        stop_session(proc, 5)
        stops.append(proc.returncode)

    with pytest.raises(ServerExited) as e:
        serve_until_stopped(lambda: "up", proc.poll, stop, "srv")
    assert (e.value.code, e.value.exit_code, stops) == (-9, 1, [-9])  # stopped once, then raised
    assert str(e.value) == "srv was killed by signal 9 (SIGKILL)"  # no log given: none named
    # the handlers serve_until_stopped replaced are back
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN
    assert signal.getsignal(signal.SIGINT) is not signal.SIG_IGN


def test_a_server_that_exits_during_start_up_is_named_with_its_log(tmp_path):
    log = tmp_path / "server.log"
    proc = subprocess.Popen([sys.executable, "-c", "print('boom', flush=True); raise SystemExit(4)"],
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    stopped = []
    with pytest.raises(MilesError, match=r"my server exited with code 4 \(log .*server.log\); its last lines:\nboom"):
        wait_until_ready(proc, lambda: False, lambda: stopped.append(1), "my server", log, 30, 0.05)
    assert stopped == [1]


def test_unused_ports_are_free_and_never_repeat():
    import socket

    from miles_procs import unused_port

    ports = [unused_port() for _ in range(20)]
    assert len(set(ports)) == 20
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # nothing holds it
