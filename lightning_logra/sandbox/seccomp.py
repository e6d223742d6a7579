"""The system calls a sandboxed program may make: a seccomp filter that is an allowlist.

The list was derived by measurement: ``strace -f`` of the interpreter (``-I -S``) running
the code reward's harness and a program that uses threads, a thread pool, asyncio, time,
maths, text, compression, sqlite in memory, files in its working directory, pipes,
signals and ctypes (``tests/helpers/sandbox.TYPICAL_PROGRAM``), and of ``setpriv``, which
runs under the filter to drop capabilities; to it were added the variants another C
library may use for the same call (``open``/``openat``, ``stat``/``statx``,
``poll``/``ppoll``, ``epoll_wait``/``epoll_pwait``), a signal handler's return, and the
socket calls that work on a socket pair. Numbers from the kernel's headers
(``asm/unistd_64.h`` for x86-64, ``asm-generic/unistd.h`` for AArch64).

Every other call fails with ``ENOSYS``, which the C library reads as "not implemented
here" and falls back where it has a fallback (``clone3`` to ``clone``, ``faccessat2`` to
``faccessat``), so a call missing from the list is an error in the program, never a crash.
Out of reach so: ``io_uring`` (its socket operations bypass any filter on ``socket``),
``unshare``, ``setns``, ``bpf``, ``perf_event_open``, ``ptrace``, ``process_vm_*``, the
key ring, ``userfaultfd``, every mount call, modules, ``kexec``, file handles, ``fanotify``,
``personality``, ``memfd_create``, the set-ID calls and the rest. Refused by name with
``EPERM``: a new process (``fork``, ``vfork``; ``clone`` unless it makes a thread, i.e.
has ``CLONE_THREAD`` and no ``CLONE_NEW*`` flag), ``socket`` of any family, and
``socketpair`` but for ``AF_UNIX`` (asyncio's self-pipe). Another machine's system call
convention (or x32's numbers) kills the process.
"""

from __future__ import annotations

import functools
import struct

# (audit architecture, column in SYSCALLS) per machine.
MACHINES = {"x86_64": (0xC000003E, 0), "aarch64": (0xC00000B7, 1)}
# name: (x86-64 number, AArch64 number), None where the machine has no such call.
SYSCALLS = {
    # memory, process, identity
    "brk": (12, 214), "mmap": (9, 222), "mprotect": (10, 226), "munmap": (11, 215), "mremap": (25, 216),
    "madvise": (28, 233), "msync": (26, 227), "execve": (59, 221), "exit": (60, 93), "exit_group": (231, 94),
    "arch_prctl": (158, None), "set_tid_address": (218, 96), "set_robust_list": (273, 99), "rseq": (334, 293),
    "futex": (202, 98), "prctl": (157, 167), "capget": (125, 90), "capset": (126, 91), "prlimit64": (302, 261),
    "getrlimit": (97, 163), "setrlimit": (160, 164), "getrusage": (98, 165), "times": (100, 153),
    "sysinfo": (99, 179), "uname": (63, 160), "umask": (95, 166), "getrandom": (318, 278), "wait4": (61, 260),
    "waitid": (247, 95), "restart_syscall": (219, 128), "sched_yield": (24, 124), "sched_getaffinity": (204, 123),
    "getcpu": (309, 168), "getpid": (39, 172), "getppid": (110, 173), "gettid": (186, 178), "getuid": (102, 174),
    "geteuid": (107, 175), "getgid": (104, 176), "getegid": (108, 177), "getresuid": (118, 148),
    "getresgid": (120, 150), "getgroups": (115, 158), "getpgid": (121, 155), "getpgrp": (111, None),
    "getsid": (124, 156),
    # signals and time
    "rt_sigaction": (13, 134), "rt_sigprocmask": (14, 135), "rt_sigreturn": (15, 139), "rt_sigsuspend": (130, 133),
    "rt_sigpending": (127, 136), "rt_sigtimedwait": (128, 137), "sigaltstack": (131, 132), "kill": (62, 129),
    "tgkill": (234, 131), "tkill": (200, 130), "pause": (34, None), "alarm": (37, None), "setitimer": (38, 103),
    "getitimer": (36, 102), "clock_gettime": (228, 113), "clock_getres": (229, 114),
    "clock_nanosleep": (230, 115), "nanosleep": (35, 101), "gettimeofday": (96, 169), "time": (201, None),
    # files and descriptors
    "read": (0, 63), "write": (1, 64), "readv": (19, 65), "writev": (20, 66), "pread64": (17, 67),
    "pwrite64": (18, 68), "preadv": (295, 69), "pwritev": (296, 70), "open": (2, None), "openat": (257, 56),
    "close": (3, 57), "close_range": (436, 436), "lseek": (8, 62), "dup": (32, 23), "dup2": (33, None),
    "dup3": (292, 24), "pipe": (22, None), "pipe2": (293, 59), "fcntl": (72, 25), "flock": (73, 32),
    "ioctl": (16, 29), "fsync": (74, 82), "fdatasync": (75, 83), "ftruncate": (77, 46), "truncate": (76, 45),
    "fallocate": (285, 47), "fadvise64": (221, 223), "sendfile": (40, 71), "copy_file_range": (326, 285),
    "stat": (4, None), "fstat": (5, 80), "lstat": (6, None), "newfstatat": (262, 79), "statx": (332, 291),
    "statfs": (137, 43), "fstatfs": (138, 44), "access": (21, None), "faccessat": (269, 48),
    "faccessat2": (439, 439), "readlink": (89, None), "readlinkat": (267, 78), "getcwd": (79, 17),
    "chdir": (80, 49), "fchdir": (81, 50), "getdents": (78, None), "getdents64": (217, 61), "mkdir": (83, None),
    "mkdirat": (258, 34), "rmdir": (84, None), "unlink": (87, None), "unlinkat": (263, 35), "rename": (82, None),
    "renameat": (264, 38), "renameat2": (316, 276), "link": (86, None), "linkat": (265, 37),
    "symlink": (88, None), "symlinkat": (266, 36), "chmod": (90, None), "fchmod": (91, 52),
    "fchmodat": (268, 53), "utimensat": (280, 88), "getxattr": (191, 8), "lgetxattr": (192, 9),
    "fgetxattr": (193, 10), "listxattr": (194, 11), "llistxattr": (195, 12), "flistxattr": (196, 13),
    "poll": (7, None), "ppoll": (271, 73), "select": (23, None), "pselect6": (270, 72),
    "epoll_create": (213, None), "epoll_create1": (291, 20), "epoll_ctl": (233, 21), "epoll_wait": (232, None),
    "epoll_pwait": (281, 22), "eventfd2": (290, 19),
    # on a socket pair's sockets
    "sendto": (44, 206), "recvfrom": (45, 207), "sendmsg": (46, 211), "recvmsg": (47, 212),
    "shutdown": (48, 210), "getsockopt": (55, 209), "setsockopt": (54, 208), "getsockname": (51, 204),
    "getpeername": (52, 205),
    # checked below, not allowed as such
    "fork": (57, None), "vfork": (58, None), "socket": (41, 198), "clone": (56, 220), "socketpair": (53, 199),
}
REFUSED = ("fork", "vfork", "socket")
CLONE_THREAD = 0x00010000
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET (clone's flags cannot say CLONE_NEWTIME).
CLONE_NEW_ANY = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
AF_UNIX = 1
EPERM, ENOSYS = 1, 38
X32_SYSCALLS = 0x40000000
ALLOW, KILL = 0x7FFF0000, 0x80000000
REFUSE, MISSING = 0x00050000 | EPERM, 0x00050000 | ENOSYS
LOAD, JUMP_EQUAL, JUMP_AT_LEAST, JUMP_SET, RETURN = 0x20, 0x15, 0x35, 0x45, 0x06
ARCH_OFFSET, NUMBER_OFFSET, FIRST_ARGUMENT_OFFSET = 4, 0, 16  # in struct seccomp_data (low 32 bits, little-endian)


def allowed_names() -> list[str]:
    return [name for name in SYSCALLS if name not in (*REFUSED, "clone", "socketpair")]


@functools.cache
def filter_program(machine: str) -> bytes:
    """The BPF program for ``machine`` (a key of ``MACHINES``), as ``prctl`` takes it."""
    arch, column = MACHINES[machine]

    def number(name: str) -> int | None:
        return SYSCALLS[name][column]

    def statement(code: int, k: int, jump_true: int = 0, jump_false: int = 0) -> bytes:
        return struct.pack("HBBI", code, jump_true, jump_false, k)

    program = [statement(LOAD, ARCH_OFFSET), statement(JUMP_EQUAL, arch, 1, 0), statement(RETURN, KILL),
               statement(LOAD, NUMBER_OFFSET), statement(JUMP_AT_LEAST, X32_SYSCALLS, 0, 1), statement(RETURN, KILL)]
    for name in REFUSED:
        if number(name) is not None:
            program += [statement(JUMP_EQUAL, number(name), 0, 1), statement(RETURN, REFUSE)]
    # A thread: CLONE_THREAD set and no namespace flag. Each block returns on every path,
    # so loading the argument over the call's number is safe.
    program += [statement(JUMP_EQUAL, number("clone"), 0, 5), statement(LOAD, FIRST_ARGUMENT_OFFSET),
                statement(JUMP_SET, CLONE_THREAD, 0, 2), statement(JUMP_SET, CLONE_NEW_ANY, 1, 0),
                statement(RETURN, ALLOW), statement(RETURN, REFUSE)]
    program += [statement(JUMP_EQUAL, number("socketpair"), 0, 4), statement(LOAD, FIRST_ARGUMENT_OFFSET),
                statement(JUMP_EQUAL, AF_UNIX, 0, 1), statement(RETURN, ALLOW), statement(RETURN, REFUSE)]
    for allowed in sorted(number(name) for name in allowed_names() if number(name) is not None):
        program += [statement(JUMP_EQUAL, allowed, 0, 1), statement(RETURN, ALLOW)]
    program.append(statement(RETURN, MISSING))
    return b"".join(program)
