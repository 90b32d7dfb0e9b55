"""The sandbox's first process (run by ``sandbox.py``; standard library only, started with -S).

Reads its spec (JSON) from stdin, then, as root of the new namespaces: makes every host mount
read-only, covers the hidden host paths with empty read-only directories, mounts a private /tmp
(+ /var/tmp, /dev/shm) and writes the code into the working directory. It then forks the code
(rlimits, the throwaway uid, exec) and writes the code's exit status to the status pipe. A setup
failure exits 125 with a ``miles-sandbox: setup failed`` line on stderr.
"""
import ctypes
import json
import os
import resource
import sys

SETUP_FAILED = 125
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
# statvfs flag -> mount flag, to keep a mount's flags when it is remounted read-only
KEEP_FLAGS = {1: MS_RDONLY, 2: MS_NOSUID, 4: MS_NODEV, 8: MS_NOEXEC, 1024: 1024, 2048: 2048, 4096: 1 << 21}
LIVE = ("/proc", "/sys", "/dev")  # kernel interfaces and devices (/dev/null) stay as they are


def mount(source, target, fstype, flags, data):
    libc = ctypes.CDLL(None, use_errno=True)
    args = [None if a is None else a.encode() for a in (source, target, fstype, data)]
    if libc.mount(args[0], args[1], args[2], ctypes.c_ulong(flags), args[3]) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {fstype or 'bind'} on {target}: {os.strerror(err)}")


def read_only_host():
    """Every host mount read-only in this namespace: the code writes only to the private
    tmpfs folders mounted afterwards, even where a host folder is world-writable."""
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        points = [line.split()[4].encode().decode("unicode_escape") for line in f]
    for path in points:
        if any(path == p or path.startswith(p + "/") for p in LIVE):
            continue
        try:
            have = os.statvfs(path).f_flag
        except OSError:  # covered by a later mount: nothing reaches it
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for st_flag, ms_flag in KEEP_FLAGS.items():
            if have & st_flag:
                flags |= ms_flag
        mount(None, path, None, flags, None)


def setup_mounts(spec):
    read_only_host()
    # the interpreter's folders stay visible (at their own paths) inside hidden ones: opened
    # before the hiding, bound back through /proc/self/fd afterwards
    keep = {k: os.open(k, os.O_PATH | os.O_DIRECTORY) for k in spec["keep"]}
    for path in spec["hide"]:
        if not os.path.isdir(path):
            mount("/dev/null", path, None, MS_BIND, None)
            continue
        flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
        mount("none", path, "tmpfs", flags, "size=64k,mode=0755")
        for k, fd in keep.items():
            if k.startswith(path + "/"):
                os.makedirs(k, exist_ok=True)
                mount(f"/proc/self/fd/{fd}", k, None, MS_BIND | MS_REC, None)
        mount(None, path, None, MS_REMOUNT | MS_RDONLY | flags, None)
    # world-writable host folders get private copies: nothing written there outlives the run
    for path in ("/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(path):
            mount("none", path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec['tmpfs_mb']}m,mode=1777")


def write_files(spec):
    work, uid = spec["workdir"], spec["uid"]
    os.makedirs(work, mode=0o700, exist_ok=True)
    for rel, text in {**spec["files"], ".stdin": spec["stdin"]}.items():
        path = os.path.join(work, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    if uid is not None:
        for root, dirs, names in os.walk(work):
            for name in [root, *(os.path.join(root, n) for n in dirs + names)]:
                os.chown(name, uid, uid)


def exec_code(spec):
    """In the forked child: limits, the throwaway uid, then the code (never returns)."""
    os.set_inheritable(spec["status_fd"], False)  # the code must not fake its own status
    stdin = os.open(os.path.join(spec["workdir"], ".stdin"), os.O_RDONLY)
    os.dup2(stdin, 0)
    os.close(stdin)
    for name, (soft, hard) in spec["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    if spec["uid"] is not None:
        os.setgroups([])
        os.setgid(spec["uid"])
        os.setuid(spec["uid"])
    os.chdir(spec["workdir"])
    argv = spec["argv"]
    os.execve(argv[0], argv, spec["env"])


def main():
    spec = json.loads(sys.stdin.buffer.read())
    try:
        if spec["mounts"]:
            setup_mounts(spec)
        write_files(spec)
    except OSError as e:
        fail(e)
    # the code runs as a child, not in place of this process: its status (a signal included)
    # goes back on the status pipe, because unshare cannot re-raise every signal (SIGXCPU)
    pid = os.fork()
    if pid == 0:
        try:
            exec_code(spec)
        except OSError as e:
            fail(e)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    os.write(spec["status_fd"], json.dumps({"returncode": code}).encode())
    os._exit(0)


def fail(e):
    print(f"miles-sandbox: setup failed: {e}", file=sys.stderr, flush=True)
    os._exit(SETUP_FAILED)


if __name__ == "__main__":
    main()
