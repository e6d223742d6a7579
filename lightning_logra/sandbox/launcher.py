"""The sandbox's own code inside the sandbox: sets up the working directory, the
filesystem view and the limits, runs the untrusted program in a child, sends back its
report and exits with its status.

Run as a script by a fresh interpreter (``python -I -S launcher.py <settings json>``), as
process 1 of new user, mount, PID, network, IPC and UTS namespaces made by ``unshare``
(or, opted out, without them); standard library only, imports nothing of the package.

Process 1 moves itself into the run's pids cgroup when there is one, then (in the
namespaces) mounts a tmpfs capped in bytes and in files over the working directory and
copies the program and its files into it, and makes every other mount read-only, without
device files (the kernel lets the namespace's root do so; fail closed: a step that fails
ends the run before the program starts). It then forks the program: new limits
(``setrlimit``), the seccomp filter it was given (``seccomp``: an allowlist), then
``setpriv`` drops all capabilities, for good (``no_new_privs``), and executes the
interpreter on the program. When the program exits, process 1 sends the program's report
file (bounded, never through a link) down its report pipe and exits with the program's
status (``128 + n`` for signal ``n``); the kernel kills whatever is left in the namespace,
and the tmpfs goes with it.
"""

import ctypes
import json
import os
import platform
import re
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


def working_directory_on_tmpfs(libc, workdir: str, names: list[str], disk: dict) -> None:
    """Mount a tmpfs of ``disk["bytes"]`` bytes and ``disk["files"]`` files and
    directories over the working directory (it hides the host directory: the program's
    files, however many, never reach the host's disk) and copy the given files into it."""
    given = {}
    for name in names:
        with open(os.path.join(workdir, name), "rb") as file:
            given[name] = file.read()
    options = f"size={disk['bytes']},nr_inodes={disk['files'] + 1},mode=700"  # + 1: its root
    _mount(libc, "tmpfs", workdir, MS_NOSUID | MS_NODEV | MS_NOEXEC, "tmpfs", options)
    for name, content in given.items():
        try:
            descriptor = os.open(os.path.join(workdir, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                                 0o600)
            with os.fdopen(descriptor, "wb") as file:
                file.write(content)
        except OSError as error:
            raise OSError(error.errno, f"copying {name!r} into the working directory (max_disk_bytes "
                                       f"{disk['bytes']}, max_files {disk['files']}): {error.strerror}") from None


def read_only_everywhere_but(libc, workdir: str) -> None:
    """Remount every mount but the working directory's tmpfs read-only, ``/proc`` and
    ``/sys`` included (where the trainer runs as root, the program's user is root's owner
    of their files: of the host's sysctls and cgroups), with no device files (``nodev``:
    an owner's write to a device node, a disk, is no file write that read-only stops) and
    no set-user-ID programs."""
    with open("/proc/self/mountinfo", encoding="utf-8") as mountinfo:
        # mountinfo writes a space, tab, newline or backslash in a path as an octal escape.
        points = {re.sub(r"\\([0-7]{3})", lambda code: chr(int(code[1], 8)), line.split()[4]) for line in mountinfo}
    for point in sorted(points - {workdir}):
        try:
            flags = os.statvfs(point).f_flag & KEPT_FLAGS
        except (FileNotFoundError, PermissionError):
            continue  # out of reach (removed, or under a directory not even process 1 may enter): so for the program
        _mount(libc, None, point, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | flags)


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
            working_directory_on_tmpfs(libc, settings["workdir"], settings["files"], settings["disk"])
            read_only_everywhere_but(libc, settings["workdir"])
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
