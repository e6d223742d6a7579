"""What the platform offers the sandbox: the commands that start a program in new
namespaces, and a one-time probe that they work here.

Needed: Linux on x86-64 or AArch64 (the seccomp filter knows their system calls), util-linux's
``unshare`` (new user, mount, PID, network, IPC and UTS namespaces: unprivileged user
namespaces, or root) and ``setpriv`` (the parent-death signal, dropping capabilities);
the C library's ``ldd`` (which libraries the program's filesystem must hold: ``view``);
a pids cgroup (``cgroups``) where threads are to be bounded for a trainer run as root.
The probe runs a small program (a thread, a file) through the real path once per
process; where it fails the sandbox refuses to run, naming what is missing, unless the
limits allow an unisolated run (``runner.namespaces_problem``).
"""

from __future__ import annotations

import platform
import shutil
import sys
from pathlib import Path

from lightning_logra.sandbox import launcher, seccomp

LAUNCHER = str(Path(launcher.__file__).resolve())
NAMESPACES = ["--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc",
              "--ipc", "--uts"]


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run here as configured; the message names what is missing."""


class SandboxWarning(UserWarning):
    """The sandbox runs programs with less isolation than it should (an opt-out, or no
    bound on threads here), or could not clean up after one."""


def machine() -> str:
    """The machine name the seccomp filter is built for; raises where it has no table."""
    name = platform.machine()
    if sys.platform != "linux" or name not in seccomp.MACHINES:
        raise SandboxUnavailable(f"the sandbox needs Linux on {' or '.join(seccomp.MACHINES)} (its seccomp filter "
                                 f"lists their system calls); this is {sys.platform} on {name}")
    return name


def tool(name: str) -> str:
    path = shutil.which(name, path="/usr/bin:/bin:/usr/sbin:/sbin")
    if path is None:
        raise SandboxUnavailable(f"the sandbox needs util-linux's `{name}` (apt-get install util-linux)")
    return path


def interpreter() -> str:
    """The Python that runs the launcher and the program: the base installation's (a
    virtual environment's packages are not wanted there: programs run with ``-I -S``)."""
    return getattr(sys, "_base_executable", None) or sys.executable


def command(settings_json: str, namespaces: bool) -> list[str]:
    """The command line that starts the launcher: the parent-death signal (the program dies
    with the process that started it), then the namespaces when ``namespaces``."""
    start = [tool("setpriv"), "--pdeathsig", "KILL", "--"]
    if namespaces:
        start += [tool("unshare"), *NAMESPACES, "--"]
    return [*start, interpreter(), "-I", "-S", LAUNCHER, settings_json]
