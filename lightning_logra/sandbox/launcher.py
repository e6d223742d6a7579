"""The sandbox's own code inside the sandbox: sets up the working directory, the
filesystem view and the limits, runs the untrusted program in a child, sends back its
report and exits with its status.

Run as a script by a fresh interpreter (``python -I -S launcher.py <settings json>``), as
process 1 of new user, mount, PID, network, IPC and UTS namespaces made by ``unshare``
(or, opted out, without them); standard library only, imports nothing of the package.

Process 1 moves itself into the run's pids cgroup when there is one, then (in the
namespaces) builds the program's filesystem, a new read-only root holding only what the
interpreter needs and the working directory, a tmpfs capped in bytes and in files with
copies of the program and its files, and moves into it (``build_root``; the kernel lets
the namespace's root do so; fail closed: a step that fails ends the run before the
program starts). It then forks the program: new limits (``setrlimit``), the seccomp
filter it was given (``seccomp``: an allowlist), then ``setpriv`` drops all capabilities,
for good (``no_new_privs``), and executes the interpreter on the program. When the
program exits, process 1 sends the program's report file (bounded, never through a link)
down its report pipe and exits with the program's status (``128 + n`` for signal ``n``);
the kernel kills whatever is left in the namespace, and the tmpfs goes with it.
"""

import ctypes
import json
import os
import platform
import resource
import stat
import sys

SETUP_FAILED = 125  # exit status when the sandbox could not be set up; the program never ran
SETUP_MESSAGE = "lightning_logra.sandbox setup failed: "
REPORT_MARKER = b"R"  # starts what the report pipe carries when there is a report (it may be empty)

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 0x1, 0x2, 0x4, 0x8, 0x20, 0x1000
# statvfs flags that a read-only remount must repeat (the kernel refuses to drop a flag
# locked by the parent namespace); they equal their MS_* counterparts.
KEPT_FLAGS = (os.ST_NOSUID | os.ST_NODEV | os.ST_NOEXEC | os.ST_NOATIME | os.ST_NODIRATIME | os.ST_RELATIME)
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}  # system call numbers: the C library has no wrapper
MNT_DETACH = 2


def install_filter(libc, code: bytes) -> None:
    buffer = ctypes.create_string_buffer(code, len(code))

    class Program(ctypes.Structure):
        _fields_ = [("length", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    program = Program(len(code) // 8, ctypes.addressof(buffer))
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(program), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


def join_cgroup(cgroup: str) -> None:
    """Move process 1 (and so the program it forks) into the run's pids cgroup, while the
    cgroup filesystem is still writable."""
    try:
        with open(os.path.join(cgroup, "cgroup.procs"), "w", encoding="ascii") as procs:
            procs.write("0")  # 0: the writing process
    except OSError as error:
        raise OSError(error.errno, f"joining the pids cgroup {cgroup}: {error.strerror}") from None


def build_root(libc, settings: dict) -> None:
    """Make the filesystem the program sees (``view`` in the package) and make it the root.

    A tmpfs over the host working directory (the given files read first) becomes the new
    root. In it: each path of ``view["binds"]`` bound at its own path, read-only, without
    device files or set-user-ID programs; the links on the way to them; an empty read-only
    tmpfs over each ``view["hidden"]`` directory (site-packages); a ``/proc`` for the new
    PID namespace, read-only; and the working directory at its own path, a tmpfs of
    ``disk["bytes"]`` bytes and ``disk["files"]`` files and directories holding copies of
    the given files. The new root is then made read-only and ``pivot_root`` moves into it;
    the old root is unmounted, so nothing of the host's files is left to reach (not through
    ``/proc/<pid>/root`` either)."""
    workdir, view = settings["workdir"], settings["view"]
    given = {}
    for name in settings["files"]:
        with open(os.path.join(workdir, name), "rb") as file:
            given[name] = file.read()
    root = workdir  # a mount point of our own, out of the way of every path below
    _mount(libc, "tmpfs", root, MS_NOSUID | MS_NODEV | MS_NOEXEC, "tmpfs", "size=1m,mode=755")
    for path, target in view["links"]:
        os.makedirs(root + os.path.dirname(path), mode=0o755, exist_ok=True)
        os.symlink(target, root + path)
    for path in view["binds"]:
        inside = root + path
        if os.path.isdir(path):
            os.makedirs(inside, mode=0o755, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(inside), mode=0o755, exist_ok=True)
            os.close(os.open(inside, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644))
        _mount(libc, path, inside, MS_BIND)
        locked = os.statvfs(path).f_flag & KEPT_FLAGS  # the kernel refuses to drop these
        _mount(libc, None, inside, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | locked)
    for path in view["hidden"]:
        _mount(libc, "tmpfs", root + path, MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "tmpfs", "size=4k,mode=555")
    os.makedirs(root + "/proc", mode=0o555)
    _mount(libc, "proc", root + "/proc", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "proc")
    os.makedirs(root + workdir, mode=0o755, exist_ok=True)
    working_directory_on_tmpfs(libc, root + workdir, given, settings["disk"])
    _mount(libc, None, root, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.chdir(root)
    # pivot_root(".", "."): the old root ends up over the new one, and is detached at once.
    if libc.syscall(ctypes.c_long(PIVOT_ROOT[settings["machine"]]), b".", b".") != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"pivot_root into the new root: {os.strerror(error)}")
    if libc.umount2(b".", MNT_DETACH) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"unmounting the old root: {os.strerror(error)}")
    os.chdir("/")


def working_directory_on_tmpfs(libc, path: str, given: dict[str, bytes], disk: dict) -> None:
    """Mount a tmpfs of ``disk["bytes"]`` bytes and ``disk["files"]`` files and
    directories at ``path`` (the program's files, however many, never reach the host's
    disk) and write the given files into it."""
    options = f"size={disk['bytes']},nr_inodes={disk['files'] + 1},mode=700"  # + 1: its root
    _mount(libc, "tmpfs", path, MS_NOSUID | MS_NODEV | MS_NOEXEC, "tmpfs", options)
    for name, content in given.items():
        try:
            descriptor = os.open(os.path.join(path, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                                 0o600)
            with os.fdopen(descriptor, "wb") as file:
                file.write(content)
        except OSError as error:
            raise OSError(error.errno, f"copying {name!r} into the working directory (max_disk_bytes "
                                       f"{disk['bytes']}, max_files {disk['files']}): {error.strerror}") from None


def _mount(libc, source: str | None, target: str, flags: int, fstype: str | None = None,
           options: str | None = None) -> None:
    encoded = [text and text.encode() for text in (source, target, fstype, options)]
    if libc.mount(encoded[0], encoded[1], encoded[2], flags, encoded[3]) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"mount {target!r} (flags {flags:#x}): {os.strerror(error)}")


def run_program(libc, settings: dict) -> None:
    """In the forked child: limits, the filter, then the interpreter on the program."""
    os.chdir(settings["workdir"])
    for name, value in settings["rlimits"].items():
        resource.setrlimit(getattr(resource, name), tuple(value))
    install_filter(libc, bytes.fromhex(settings["seccomp_filter"]))
    command = [sys.executable, "-I", "-S", settings["program"]]
    if settings["drop_capabilities"]:
        command = [settings["setpriv"], "--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-all", "--",
                   *command]
    os.execve(command[0], command, settings["environment"])


def send_report(workdir: int, name: str, limit: int, pipe: int) -> None:
    """The marker and the first ``limit`` bytes of the report file down the pipe; nothing
    when there is no regular file there. Opened in the working directory as process 1
    opened it before the program started (the program may rename directories), never
    through a link: the program could point one anywhere, and process 1 may read what the
    program may not."""
    try:
        descriptor = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=workdir)
    except OSError:
        return
    with os.fdopen(descriptor, "rb") as report:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            return
        message = memoryview(REPORT_MARKER + report.read(limit))
    try:
        while message:
            message = message[os.write(pipe, message):]
    except OSError:
        pass  # the run stopped listening (timed out): the report is not wanted


def main() -> int:
    settings = json.loads(sys.argv[1])
    libc = ctypes.CDLL(None, use_errno=True)
    report_pipe = settings["report_pipe"]
    try:
        if platform.machine() != settings["machine"]:
            raise OSError(f"running on {platform.machine()}, set up for {settings['machine']}")
        if settings["cgroup"] is not None:
            join_cgroup(settings["cgroup"])
        if settings["namespaces"]:
            build_root(libc, settings)
        workdir = os.open(settings["workdir"], os.O_RDONLY | os.O_DIRECTORY)  # not inherited by the program
    except OSError as error:
        print(SETUP_MESSAGE + str(error), file=sys.stderr, flush=True)
        return SETUP_FAILED
    child = os.fork()
    if child == 0:
        try:
            os.close(report_pipe)
            run_program(libc, settings)
        except BaseException as error:  # noqa: BLE001 - whatever stops the program from starting
            print(SETUP_MESSAGE + f"{type(error).__name__}: {error}", file=sys.stderr, flush=True)
        os._exit(SETUP_FAILED)
    while True:  # as process 1, also reap any orphan until the program itself ends
        pid, status = os.wait()
        if pid == child:
            break
    send_report(workdir, settings["report_file"], settings["report_bytes"], report_pipe)
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


if __name__ == "__main__":
    sys.exit(main())
