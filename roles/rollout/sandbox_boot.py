"""The sandbox's bootstrap: `python -I -B sandbox_boot.py CPU_S MEM_MB FILE_MB FILES PROCS CODE`
(standard library only; roles/rollout/sandbox.py runs it). Isolates, then runs CODE (a file)
as `python -I -B main.py`; exits 97 with one `sandbox: ...` line where any step fails, so
the code never runs with less isolation than this promises:

* a new user namespace whose uid 0 is an unprivileged uid outside (65534 where the caller
  is root, else the caller's own uid), no supplementary groups, every capability dropped
  and `no_new_privs` before the code starts;
* new PID, mount, network, IPC and UTS namespaces. The code's parent is a tiny init (PID 1
  of the namespace): when the init dies every process of the namespace dies, a `setsid`
  one included. This process (outside the namespace) kills the init on SIGTERM, and the
  init gets SIGKILL when this process dies;
* a root of its own: a read-only tmpfs with read-only binds of /usr (and /bin, /lib...) and
  the interpreter's prefixes, a few device nodes, a fresh /proc of the new PID namespace
  (an empty /proc where the kernel refuses one, as in containers that mask parts of
  theirs), and empty writable tmpfs /tmp and /sandbox (the working directory). No host /proc,
  /etc, /home, /root, /run or run directory, so no host file-system unix socket either;
* no network interface up (not even loopback), so no TCP/UDP, and abstract unix sockets
  are per network namespace;
* RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_NOFILE and RLIMIT_NPROC (processes and
  threads, counted in the new user namespace).
"""

import ctypes
import os
import platform
import resource
import signal
import sys

SETUP_FAILED = 97
NOBODY = 65534
WORKDIR = "/sandbox"
NEWNS, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET = 0x20000, 0x4000000, 0x8000000, 0x10000000, 0x20000000, 0x40000000
RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, NOATIME, NODIRATIME = 1, 2, 4, 8, 32, 1024, 2048
BIND, REC, PRIVATE, RELATIME, STRICTATIME = 4096, 16384, 1 << 18, 1 << 21, 1 << 24
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 28, 38
SECBIT_NOROOT_LOCKED = 0x3  # uid 0 gains no capabilities on exec, and that cannot be undone
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
DEVICES = ("null", "zero", "full", "random", "urandom")

libc = ctypes.CDLL(None, use_errno=True)
ROOT_CALLER = os.geteuid() == 0


def check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def fail(what: object) -> None:
    os.write(2, f"sandbox: {what}\n".encode())
    os._exit(SETUP_FAILED)


def mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = [s.encode() if s is not None else None for s in (src, dst, fstype, data)]
    check(libc.mount(enc[0], enc[1], enc[2], flags, enc[3]), f"mount {dst}")


def enter_user_namespace() -> None:
    """Unshare the user namespace; a helper left outside writes its uid and gid maps (only
    a process with CAP_SETUID outside may map uid 0 inside to an uid other than its own)."""
    outer_uid, outer_gid = (NOBODY, NOBODY) if ROOT_CALLER else (os.geteuid(), os.getegid())
    r, w = os.pipe()
    helper = os.fork()
    if helper == 0:
        os.close(w)
        os.read(r, 1)  # EOF once the parent has unshared
        try:
            if not ROOT_CALLER:  # unprivileged: a gid map needs setgroups denied
                write_proc(os.getppid(), "setgroups", "deny")
            write_proc(os.getppid(), "uid_map", f"0 {outer_uid} 1")
            write_proc(os.getppid(), "gid_map", f"0 {outer_gid} 1")
        except OSError as e:
            fail(f"id map: {e}")
        os._exit(0)
    os.close(r)
    ret = libc.unshare(NEWUSER)
    err = ctypes.get_errno()
    if ret != 0:
        os.kill(helper, signal.SIGKILL)
    os.close(w)
    _, status = os.waitpid(helper, 0)
    if ret != 0:
        raise OSError(err, f"unshare(user): {os.strerror(err)}")
    if status != 0:
        os._exit(SETUP_FAILED)  # the helper said why


def write_proc(pid: int, name: str, text: str) -> None:
    with open(f"/proc/{pid}/{name}", "w") as f:
        f.write(text)


def bind_read_only(src_fd: int, dst: str) -> None:
    mount(f"/proc/self/fd/{src_fd}", dst, None, BIND | REC)
    # Flags a less privileged namespace may not drop (nosuid, nodev, noexec, atime) stay.
    have = os.statvfs(src_fd).f_flag
    flags = REMOUNT | BIND | RDONLY | NOSUID | NODEV | (have & (NOEXEC | NOATIME | NODIRATIME))
    flags |= RELATIME if have & 4096 else 0 if have & NOATIME else STRICTATIME
    mount(None, dst, None, flags)


def build_root(root: str, file_mb: int) -> None:
    """Make `root` (an existing directory) the new root, see the module docs."""
    # Sources are opened while this process still has the caller's uid: /root may be 0700.
    names = [n for n in ("usr", "bin", "sbin", "lib", "lib32", "lib64") if os.path.lexists("/" + n)]
    prefixes = sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix) if not p.startswith("/usr/")})
    if "/" in prefixes:
        raise OSError(0, "the interpreter's prefix is /: binding it would show the host's whole tree")
    sources = {p: os.open(p, os.O_PATH) for p in ["/" + n for n in names if not os.path.islink("/" + n)] + prefixes}
    devices = {d: os.open("/dev/" + d, os.O_PATH) for d in DEVICES if os.path.exists("/dev/" + d)}
    become_namespace_root()
    mount(None, "/", None, REC | PRIVATE)
    mount("tmpfs", root, "tmpfs", NOSUID | NODEV, "mode=0755,size=1m")
    for sub, mode in (("tmp", "1777"), (WORKDIR[1:], "0755")):
        os.mkdir(f"{root}/{sub}")
        mount("tmpfs", f"{root}/{sub}", "tmpfs", NOSUID | NODEV, f"mode={mode},size={4 * file_mb}m")
    for n in names:
        if os.path.islink("/" + n):
            os.symlink(os.readlink("/" + n), f"{root}/{n}")
    for path, fd in sources.items():
        os.makedirs(root + path, exist_ok=True)
        bind_read_only(fd, root + path)
    os.mkdir(f"{root}/dev")
    for name, fd in devices.items():
        open(f"{root}/dev/{name}", "w").close()
        mount(f"/proc/self/fd/{fd}", f"{root}/dev/{name}", None, BIND)
    os.mkdir(f"{root}/proc")
    try:
        mount("proc", f"{root}/proc", "proc", NOSUID | NODEV | NOEXEC)
    except OSError:
        pass  # a container that masks parts of its /proc refuses a new one: then none at all
    pivot_root(root)
    mount(None, "/", None, REMOUNT | BIND | RDONLY | NOSUID | NODEV)


def become_namespace_root() -> None:
    """Take uid/gid 0 of the new namespace (the unprivileged uid outside) and drop the
    caller's supplementary groups (refused, and not needed, where setgroups is denied)."""
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    if ROOT_CALLER:
        os.setgroups([])


def pivot_root(root: str) -> None:
    number = SYS_PIVOT_ROOT.get(platform.machine())
    if number is None:
        raise OSError(0, f"pivot_root: unknown on {platform.machine()}")
    os.chdir(root)
    check(libc.syscall(number, b".", b"."), "pivot_root")
    check(libc.umount2(b".", 2), "umount old root")  # MNT_DETACH: the host's tree is gone
    os.chdir("/")


def drop_capabilities() -> None:
    check(libc.prctl(PR_SET_SECUREBITS, SECBIT_NOROOT_LOCKED, 0, 0, 0), "securebits")
    for cap in range(64):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # EINVAL past the last one
    header, data = (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()
    check(libc.capset(header, data), "capset")
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def run_code(cpu: int, mem: int, fsize: int, nofile: int, nproc: int) -> None:
    try:
        os.chdir(WORKDIR)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (mem << 20, mem << 20))
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize << 20, fsize << 20))
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        drop_capabilities()
        os.execv(sys.executable, [sys.executable, "-I", "-B", "main.py"])
    except OSError as e:
        fail(e)


def run_init(root: str, code: bytes, limits: list[int]) -> None:
    """PID 1 of the new namespace: set up the root, start the code, reap, exit with its status."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # PID 1 ignores signals it has no handler for
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # the code may not ptrace its init
    try:
        build_root(root, limits[2])
        with open(f"{WORKDIR}/main.py", "wb") as f:
            f.write(code)
    except OSError as e:
        fail(e)
    child = os.fork()
    if child == 0:
        run_code(*limits)
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == child:
            os._exit(exit_status(status))


def exit_status(status: int) -> int:
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def main(argv: list[str]) -> None:
    limits, code_path = [int(a) for a in argv[1:6]], argv[6]
    with open(code_path, "rb") as f:
        code = f.read()
    parent = os.getppid()
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)
    init: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: os.kill(init[0], signal.SIGKILL) if init else os._exit(1))
    try:
        enter_user_namespace()
        check(libc.unshare(NEWNS | NEWNET | NEWIPC | NEWUTS | NEWPID), "unshare(pid, mount, net, ipc, uts)")
    except OSError as e:
        fail(e)
    pid = os.fork()
    if pid == 0:
        run_init(os.path.dirname(code_path), code, limits)
    init.append(pid)
    _, status = os.waitpid(pid, 0)
    os._exit(exit_status(status))


if __name__ == "__main__":
    main(sys.argv)
