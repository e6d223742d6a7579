"""The sandbox's own code inside the sandbox: sets up the filesystem view and the limits,
then runs the untrusted program in a child and exits with its status.

Run as a script by a fresh interpreter (``python -I -S launcher.py <settings json>``), as
process 1 of new user, mount, PID, network, IPC and UTS namespaces made by ``unshare``
(or, opted out, without them); standard library only, imports nothing of the package.

Process 1 makes every mount read-only, without device files, except a bind mount of the
working directory (the kernel lets the namespace's root do so; fail closed: a mount it
cannot remount ends the run before the program starts), then forks the program: new limits
(``setrlimit``), a seccomp filter that refuses every new process (threads stay allowed)
and Unix-domain sockets,
then ``setpriv`` drops all capabilities, for good (``no_new_privs``), and executes the
interpreter on the program. When the program exits, process 1 exits with its status
(``128 + n`` for signal ``n``) and the kernel kills whatever is left in the namespace.
"""

import ctypes
import json
import os
import platform
import re
import resource
import struct
import sys

SETUP_FAILED = 125  # exit status when the sandbox could not be set up; the program never ran
SETUP_MESSAGE = "lightning_logra.sandbox setup failed: "

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND = 0x1, 0x2, 0x4, 0x20, 0x1000
# statvfs flags that a read-only remount must repeat (the kernel refuses to drop a flag
# locked by the parent namespace); they equal their MS_* counterparts.
KEPT_FLAGS = (os.ST_NOSUID | os.ST_NODEV | os.ST_NOEXEC | os.ST_NOATIME | os.ST_NODIRATIME | os.ST_RELATIME)

PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
CLONE_THREAD = 0x00010000
AF_UNIX = 1
EPERM, ENOSYS = 1, 38
X32_SYSCALLS = 0x40000000  # x86-64's x32 numbering, which the filter would not recognise: refused
# (audit arch, syscalls that always make a process, clone, clone3, socket) per machine.
SYSCALLS = {
    "x86_64": (0xC000003E, (57, 58), 56, 435, 41),   # fork, vfork; clone; clone3; socket
    "aarch64": (0xC00000B7, (), 220, 435, 198),
}


def seccomp_filter(machine: str) -> bytes:
    """A seccomp BPF program: fork and vfork fail with EPERM, clone too unless it makes a
    thread (CLONE_THREAD in its flags), clone3 with ENOSYS (its flags sit behind a pointer
    the filter cannot read; the C library then falls back to clone); a Unix-domain socket
    fails with EPERM (a read-only mount does not stop connecting to a socket file, such as
    a container runtime's, which the program's user may own); any other machine's system
    call convention (or x32's numbers) kills the process."""
    arch, forks, clone, clone3, socket = SYSCALLS[machine]
    allow, kill = 0x7FFF0000, 0x80000000
    refuse, missing = 0x00050000 | EPERM, 0x00050000 | ENOSYS

    def statement(code: int, k: int, jump_true: int = 0, jump_false: int = 0) -> bytes:
        return struct.pack("HBBI", code, jump_true, jump_false, k)

    load, jump_equal, jump_at_least, jump_set, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    program = [statement(load, 4), statement(jump_equal, arch, 1, 0), statement(ret, kill), statement(load, 0),
               statement(jump_at_least, X32_SYSCALLS, 0, 1), statement(ret, kill)]
    for number in forks:
        program += [statement(jump_equal, number, 0, 1), statement(ret, refuse)]
    program += [statement(jump_equal, clone3, 0, 1), statement(ret, missing),
                statement(jump_equal, clone, 0, 4), statement(load, 16),  # clone's flags (low 32 bits)
                statement(jump_set, CLONE_THREAD, 0, 1), statement(ret, allow), statement(ret, refuse),
                statement(jump_equal, socket, 0, 4), statement(load, 16),  # socket's domain
                statement(jump_equal, AF_UNIX, 0, 1), statement(ret, refuse), statement(ret, allow),
                statement(ret, allow)]
    return b"".join(program)


def install_filter(libc, machine: str) -> None:
    code = seccomp_filter(machine)
    buffer = ctypes.create_string_buffer(code, len(code))

    class Program(ctypes.Structure):
        _fields_ = [("length", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    program = Program(len(code) // 8, ctypes.addressof(buffer))
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(program), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


def read_only_everywhere_but(libc, workdir: str) -> None:
    """Bind the working directory onto itself (a mount of its own, left writable), then
    remount every other mount read-only, ``/proc`` and ``/sys`` included (where the trainer
    runs as root, the program's user is root's owner of their files: of the host's
    sysctls), with no device files (``nodev``: an owner's write to a device node, a disk,
    is no file write that read-only stops) and no set-user-ID programs."""
    _mount(libc, workdir, workdir, MS_BIND)
    with open("/proc/self/mountinfo", encoding="utf-8") as mountinfo:
        # mountinfo writes a space, tab, newline or backslash in a path as an octal escape.
        points = {re.sub(r"\\([0-7]{3})", lambda code: chr(int(code[1], 8)), line.split()[4]) for line in mountinfo}
    for point in sorted(points - {workdir}):
        try:
            flags = os.statvfs(point).f_flag & KEPT_FLAGS
        except (FileNotFoundError, PermissionError):
            continue  # out of reach (removed, or under a directory not even process 1 may enter): so for the program
        _mount(libc, None, point, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | flags)


def _mount(libc, source: str | None, target: str, flags: int) -> None:
    if libc.mount(source and source.encode(), target.encode(), None, flags, None) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"mount {target!r} (flags {flags:#x}): {os.strerror(error)}")


def run_program(libc, settings: dict) -> None:
    """In the forked child: limits, the filter, then the interpreter on the program."""
    os.chdir(settings["workdir"])
    for name, value in settings["rlimits"].items():
        resource.setrlimit(getattr(resource, name), tuple(value))
    install_filter(libc, settings["machine"])
    command = [sys.executable, "-I", "-S", settings["program"]]
    if settings["drop_capabilities"]:
        command = [settings["setpriv"], "--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-all", "--",
                   *command]
    os.execve(command[0], command, settings["environment"])


def main() -> int:
    settings = json.loads(sys.argv[1])
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        if settings["namespaces"]:
            read_only_everywhere_but(libc, settings["workdir"])
        if platform.machine() != settings["machine"]:
            raise OSError(f"running on {platform.machine()}, set up for {settings['machine']}")
    except OSError as error:
        print(SETUP_MESSAGE + str(error), file=sys.stderr, flush=True)
        return SETUP_FAILED
    child = os.fork()
    if child == 0:
        try:
            run_program(libc, settings)
        except BaseException as error:  # noqa: BLE001 - whatever stops the program from starting
            print(SETUP_MESSAGE + f"{type(error).__name__}: {error}", file=sys.stderr, flush=True)
        os._exit(SETUP_FAILED)
    while True:  # as process 1, also reap any orphan until the program itself ends
        pid, status = os.wait()
        if pid == child:
            return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


if __name__ == "__main__":
    sys.exit(main())
