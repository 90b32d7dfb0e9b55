"""Hostile snippets against the sandbox: each is contained, the caller gets a result, and nothing
is left running afterwards. Everything is bounded (small process counts, timeouts of 1-2 s)."""
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path

import miles_sandbox.sandbox as sb
import pytest
from miles import MilesError
from miles_plugin_sandbox import (
    Limits,
    SandboxError,
    SandboxResult,
    run_python,
    run_shell,
)

SMALL = Limits(max_procs=16, memory_mb=512)


def sandbox_processes() -> list[int]:
    """Live processes owned by a sandbox uid (the throwaway uids are 100000-159999)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            status = (entry / "status").read_text()
        except (OSError, ValueError):
            continue
        uid = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
        if 100000 <= uid < 160000 and "State:\tZ" not in status:
            pids.append(int(entry.name))
    return pids


@pytest.fixture
def visible_dir():
    """A world-readable folder outside /tmp (the sandbox has its own /tmp), removed afterwards."""
    parent = next((d for d in ("/run", "/var/lib", "/opt") if os.access(d, os.W_OK)), None)
    if parent is None:
        pytest.skip("no writable folder outside /tmp")
    folder = Path(tempfile.mkdtemp(prefix="miles-sandbox-test-", dir=parent))
    folder.chmod(0o755)
    secret = folder / "secret.txt"
    secret.write_text("run-folder-secret")
    secret.chmod(0o644)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_plain_code_runs_and_returns_a_frozen_result():
    r = run_python("import sys; print(input()); print('err', file=sys.stderr); sys.exit(3)", 10, stdin="hello\n")
    assert isinstance(r, SandboxResult)
    assert (r.stdout, r.stderr, r.returncode, r.timed_out) == ("hello\n", "err\n", 3, False)
    with pytest.raises(AttributeError):
        r.stdout = "x"  # frozen
    s = run_shell("cat data/in.txt; echo $((6 * 7)); exit 4", 10, files={"data/in.txt": "given\n"})
    assert (s.stdout, s.returncode) == ("given\n42\n", 4)
    assert issubclass(SandboxError, MilesError)


def test_infinite_loop_is_stopped():
    started = time.monotonic()
    r = run_python("while True:\n    pass\n", 1.5)
    assert r.returncode != 0 and time.monotonic() - started < 6
    assert r.timed_out or r.returncode < 0  # the wall clock or the CPU limit, whichever first


def test_cpu_time_and_file_size_limits():
    # the CPU limit ends a busy loop before a generous wall clock does (SIGXCPU, then SIGKILL)
    r = run_python("while True:\n    pass\n", 30, limits=Limits(cpu_s=1))
    assert not r.timed_out and r.returncode in (-signal.SIGXCPU, -signal.SIGKILL), r
    big = run_python("open('big', 'wb').write(b'x' * 3 * 1024 * 1024)", 10, limits=Limits(file_size_mb=1))
    assert big.returncode == 1 and "File too large" in big.stderr


def test_fork_bomb_is_contained_and_cleaned_up():
    r = run_shell(":(){ :|:& };:", 2, limits=SMALL)
    assert r.timed_out or r.returncode != 0
    time.sleep(0.2)
    assert sandbox_processes() == []
    assert run_python("print('still fine')", 10).stdout == "still fine\n"


def test_escaped_processes_die_with_the_sandbox():
    # a background process in its own session outlives neither a normal exit nor the timeout
    for code, timeout in (("setsid sleep 60 & echo started", 10), ("setsid sleep 60 & sleep 60", 1)):
        r = run_shell(code, timeout, limits=SMALL)
        assert r.timed_out == (timeout == 1)
        time.sleep(0.2)
        assert sandbox_processes() == []


def test_ten_gigabyte_allocation_fails_inside():
    r = run_python("x = bytearray(10 * 1024 ** 3)\nprint('allocated')", 10, limits=SMALL)
    assert r.returncode == 1 and "MemoryError" in r.stderr and "allocated" not in r.stdout


def test_writes_outside_the_working_directory_do_not_reach_the_host(visible_dir):
    name = f"miles-sandbox-probe-{uuid.uuid4().hex}"
    shared = visible_dir / "shared"  # world-writable: only a read-only mount keeps the code out
    shared.mkdir(mode=0o777)
    shared.chmod(0o1777)
    code = f"""
import os
for path in ("/tmp/{name}", "/etc/{name}", "{visible_dir}/{name}", "/{name}", "{shared}/{name}"):
    try:
        open(path, "w").write("x")
        print("wrote", path)
    except OSError as e:
        print("refused", path, type(e).__name__)
open("local.txt", "w").write("x")
print("cwd", os.getcwd())
"""
    r = run_python(code, 10)
    assert r.returncode == 0, r.stderr
    assert f"wrote /tmp/{name}" in r.stdout  # its private /tmp
    assert f"refused /etc/{name}" in r.stdout and f"refused /{name}" in r.stdout
    assert f"refused {shared}/{name}" in r.stdout
    for path in (f"/tmp/{name}", f"/etc/{name}", f"{visible_dir}/{name}", f"/{name}", f"{shared}/{name}"):
        assert not os.path.exists(path)
    cwd = r.stdout.split("cwd ")[1].strip()
    assert not os.path.exists(os.path.join(cwd, "local.txt"))  # the working directory is gone


def test_no_network_even_to_loopback():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    code = f"""
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2)
    print("connected")
except OSError as e:
    print("blocked", type(e).__name__)
"""
    try:
        denied = run_python(code, 10)
        assert "blocked" in denied.stdout and not accepted, denied
        allowed = run_python(code, 10, network="allow")  # the server is reachable when allowed
        assert "connected" in allowed.stdout, allowed
    finally:
        server.close()


def test_host_files_outside_the_allow_list_are_out_of_reach(visible_dir, monkeypatch):
    code = f"""
import os
try:
    print(open("{visible_dir}/secret.txt").read())
except OSError as e:
    print("unreachable", type(e).__name__)
print(sorted(k for k in os.environ if "MILES" in k), os.environ["HOME"] == os.getcwd())
"""
    monkeypatch.setenv("MILES_TEST_SECRET_TOKEN", "abc")
    seen = run_python(code, 10)
    assert "unreachable" in seen.stdout and "run-folder-secret" not in seen.stdout
    assert "[] True" in seen.stdout  # the caller's environment does not reach the code
    shown = run_python(code, 10, allow=[str(visible_dir)])  # readable once allowed: the test can fail
    assert "run-folder-secret" in shown.stdout
    hidden = run_python(code, 10, allow=[str(visible_dir)], hide=[str(visible_dir)])
    assert "unreachable" in hidden.stdout and "run-folder-secret" not in hidden.stdout
    monkeypatch.chdir(visible_dir)  # the caller's working directory (a run folder) is hidden
    assert "run-folder-secret" not in run_shell(f"cat {visible_dir}/secret.txt secret.txt ~/secret.txt", 10).stdout
    listing = run_shell("ls /", 10).stdout.split()
    assert {"usr", "etc", "tmp", "proc", "dev"} <= set(listing)
    assert not {"home", "mnt", "opt", "srv", "work"} & set(listing)  # not system folders: not there


CHILDREN = """
import subprocess, sys
kid = "b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096]); print('allocated', flush=True); " \\
      "import time; time.sleep(1)"
kids = [subprocess.Popen([sys.executable, "-c", kid]) for _ in range({n})]
print("exits", [k.wait() for k in kids])
"""


def _own_sandbox_cgroups() -> list[str]:
    from miles_sandbox import cgroup

    found = []
    for key in ("v2", "memory"):
        mount, own = cgroup._mounts().get(key), cgroup._own(key)
        if mount and own is not None:
            found += [p.name for p in (Path(mount) / own.lstrip("/")).glob("miles-sandbox-*")]
    return found


def test_the_memory_limit_bounds_all_the_processes_of_a_call_together():
    # four children of 300 MB each: 1.2 GB if each process had its own 512 MiB limit
    r = run_python(CHILDREN.format(n=4), 20, limits=Limits(memory_mb=512, max_procs=16))
    allocated = r.stdout.count("allocated")
    if r.memory_bound.startswith("cgroup"):
        assert allocated < 4 and r.memory_peak_mb <= 512, r
        assert any("out of memory" in n for n in r.notes), r
    else:  # a host without cgroups: the limit is divided, 128 MiB a process
        assert r.memory_bound.startswith("rlimit: 4 process(es) x 128 MiB") and allocated == 0, r
    assert _own_sandbox_cgroups() == []  # each call's cgroup is removed with it


def test_without_a_cgroup_the_limit_is_divided_among_fewer_processes(monkeypatch):
    monkeypatch.setattr(sb.cgroup, "make", lambda *a: (None, "none here"))
    r = run_python(CHILDREN.format(n=3), 20, limits=Limits(memory_mb=512, max_procs=16))
    assert r.memory_bound == "rlimit: 4 process(es) x 128 MiB (no cgroup: none here)"
    assert r.returncode == 0 and "allocated" not in r.stdout and "MemoryError" in r.stderr, r
    assert "BlockingIOError" in run_python(CHILDREN.format(n=4), 20, limits=Limits(memory_mb=512)).stderr


def test_a_v2_call_group_goes_beside_a_cgroup_that_cannot_hand_memory_down(tmp_path):
    # (a file tree standing in for cgroupfs: this host may mount no v2 memory controller)
    from miles_sandbox.cgroup import _v2_parent

    own = tmp_path / "service"
    own.mkdir()
    (own / "cgroup.subtree_control").write_text("")
    assert _v2_parent(own, tmp_path) == own and (own / "cgroup.subtree_control").read_text() == "+memory +pids"
    busy = tmp_path / "busy"
    (busy / "cgroup.subtree_control").mkdir(parents=True)  # the write fails, as EBUSY makes it
    assert _v2_parent(busy, tmp_path) == tmp_path
    with pytest.raises(OSError):  # at the top of the hierarchy there is nowhere beside it
        _v2_parent(busy, busy)


def test_output_is_truncated():
    r = run_python("print('x' * 1_000_000)", 10, limits=Limits(max_output_bytes=1000))
    assert r.stdout == "x" * 1000 and r.truncated and r.returncode == 0


def test_without_namespaces_it_fails_closed_unless_the_network_is_allowed(monkeypatch):
    monkeypatch.setattr(sb, "UNSHARE", "/nonexistent/unshare")
    sb._probe.cache_clear()
    try:
        with pytest.raises(SandboxError, match="network='allow'"):
            run_python("print('ran')", 5)
        # (shell: the throwaway uid may not reach this interpreter when no mount namespace
        # can bind it into view, e.g. a pyenv Python under /root)
        r = run_shell("echo ran $(pwd)", 5, network="allow")
        assert r.stdout.startswith("ran ") and r.notes
        assert not os.path.exists(r.stdout.split()[1])  # its temporary folder is removed
    finally:
        sb._probe.cache_clear()


def test_bad_arguments_are_clear_errors():
    with pytest.raises(SandboxError, match="network"):
        run_python("pass", 5, network="maybe")
    with pytest.raises(SandboxError, match="relative"):
        run_python("pass", 5, files={"../x": ""})


def test_parallel_runs_from_threads_are_independent():
    # rollouts call the sandbox from many threads at once: each run keeps its own files and output
    from concurrent.futures import ThreadPoolExecutor

    code = "import os, sys; open('me', 'w').write(sys.argv[0]); print(os.getuid(), open('x').read())"
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: run_python(code, 20, files={"x": str(i)}), range(4)))
    assert [r.stdout.split()[1] for r in results] == ["0", "1", "2", "3"]
    assert all(r.returncode == 0 for r in results)
