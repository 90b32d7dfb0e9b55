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
