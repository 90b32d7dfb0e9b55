"""The sandbox's first process (run by ``sandbox.py``; standard library only, started with -S).

Reads its spec (JSON) from stdin, joins the call's cgroup (when there is one), then, as root of
the new namespaces, moves into a new root that holds only the allow-listed host paths (the system
folders and the interpreter's, read-only), a private /tmp (+ /var/tmp, /dev/shm), /proc and a few
devices, and writes the code into the working directory. It then forks the code
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
MS_PRIVATE, MNT_DETACH = 1 << 18, 2
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}  # syscall numbers
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
LIBC = ctypes.CDLL(None, use_errno=True)
# statvfs flag -> mount flag, to keep a mount's flags when it is remounted read-only
KEEP_FLAGS = {1: MS_RDONLY, 2: MS_NOSUID, 4: MS_NODEV, 8: MS_NOEXEC, 1024: 1024, 2048: 2048, 4096: 1 << 21}
LIVE = ("/proc", "/sys", "/dev")  # kernel interfaces and devices (/dev/null) stay as they are


def mount(source, target, fstype, flags, data):
    args = [None if a is None else a.encode() for a in (source, target, fstype, data)]
    if LIBC.mount(args[0], args[1], args[2], ctypes.c_ulong(flags), args[3]) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {fstype or 'bind'} on {target}: {os.strerror(err)}")


def remount_read_only(path):
    """``path``'s mount read-only, keeping its other flags (a user namespace may not drop them)."""
    have = os.statvfs(path).f_flag
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY
    for st_flag, ms_flag in KEEP_FLAGS.items():
        if have & st_flag:
            flags |= ms_flag
    mount(None, path, None, flags, None)


def read_only_host():
    """Every host mount read-only in this namespace, so the binds made from them are read-only too,
    submounts included."""
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        points = [line.split()[4].encode().decode("unicode_escape") for line in f]
    for path in points:
        if any(path == p or path.startswith(p + "/") for p in LIVE):
            continue
        try:
            os.statvfs(path)
        except OSError:  # covered by a later mount: nothing reaches it
            continue
        remount_read_only(path)


def _bind(source, target, is_dir):
    if is_dir:
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    mount(source, target, None, MS_BIND | MS_REC, None)


def setup_mounts(spec):
    """A new root holding only the allow-listed host paths (read-only), a private /tmp and
    /var/tmp, the namespace's /proc and a few devices; the rest of the host is not in it."""
    mount(None, "/", None, MS_REC | MS_PRIVATE, None)  # nothing below propagates to the host
    read_only_host()
    opened, links = {}, {}
    for path in spec["allow"]:  # opened before /tmp is covered: an allowed path may lie in it
        if os.path.islink(path):
            links[path] = os.readlink(path)  # /bin -> usr/bin: the link, its target is allowed too
        elif os.path.exists(path) and not any(path.startswith(p + "/") for p in opened):
            opened[path] = (os.open(path, os.O_PATH), os.path.isdir(path))
    root = "/tmp"  # a mount point every host has; in this namespace only
    mount("none", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for path, (fd, is_dir) in opened.items():
        _bind(f"/proc/self/fd/{fd}", root + path, is_dir)
        remount_read_only(root + path)
        os.close(fd)
    for path, target in links.items():
        os.makedirs(os.path.dirname(root + path), exist_ok=True)
        os.symlink(target, root + path)
    _bind("/proc", root + "/proc", True)  # this pid namespace's own (unshare --mount-proc)
    os.makedirs(root + "/dev/shm")
    for dev in (d for d in DEVICES if os.path.exists(f"/dev/{d}")):
        _bind(f"/dev/{dev}", f"{root}/dev/{dev}", False)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{root}/dev/{name}")
    for path in spec["hide"]:  # inside an allowed folder: covered by an empty read-only one
        if not os.path.lexists(root + path):
            continue
        if not os.path.isdir(root + path):
            mount("/dev/null", root + path, None, MS_BIND, None)
            continue
        flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
        mount("none", root + path, "tmpfs", flags, "size=64k,mode=0755")
        mount(None, root + path, None, MS_REMOUNT | MS_RDONLY | flags, None)
    for path in ("/tmp", "/var/tmp", "/dev/shm"):  # private and writable: gone with the run
        os.makedirs(root + path, exist_ok=True)
        mount("none", root + path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec['tmpfs_mb']}m,mode=1777")
    os.chdir(root)
    if LIBC.syscall(PIVOT_ROOT[os.uname().machine], b".", b".") != 0 or LIBC.umount2(b".", MNT_DETACH) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"pivot_root into the new root: {os.strerror(err)}")
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None)


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
    try:  # under the memory bound the code's processes, not this one, are the first to go
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass
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
        if spec["cgroup"]:  # first: everything started from here on shares the call's memory bound
            with open(spec["cgroup"], "w") as f:
                f.write("0")
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
