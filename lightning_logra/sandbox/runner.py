"""Run one untrusted Python program in the sandbox and say what happened.

The program runs in a fresh interpreter (``-I -S``: no site-packages, no environment
variables read, no user directories), never in the calling process, started as its own
session in new namespaces (see ``isolation`` and ``launcher``), seeing only the files
``view`` lists, in a working directory of its own (a capped tmpfs at the path of a new
temporary directory, which is removed afterwards), with
a fixed environment (``PATH``, ``LANG``, ``HOME`` and ``TMPDIR`` the working directory:
none of the caller's variables). Its stdout and stderr are read together up to
``max_output_bytes``, the rest read and discarded; its report comes back on a pipe of its
own. Past ``timeout_s`` the whole process group is killed, and the namespace's process 1
with it, which takes every process left in the namespace.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import re
import selectors
import signal
import subprocess
import time
import warnings
from dataclasses import dataclass, field
from typing import Literal

from lightning_logra.sandbox import cgroups, isolation, launcher, seccomp, view, workdir
from lightning_logra.sandbox.isolation import SandboxUnavailable, SandboxWarning
from lightning_logra.sandbox.limits import SandboxLimits

Status = Literal["ok", "error", "timeout", "cpu_limit", "memory", "killed", "setup_failed"]
PROGRAM_FILE = "program.py"
# A program may leave its findings in this file of its working directory (e.g. which tests
# passed); up to max_output_bytes of it come back as SandboxResult.report.
REPORT_FILE = "report.txt"
ENVIRONMENT_PATH = "/usr/local/bin:/usr/bin:/bin"
OPEN_FILES = 64
# Seconds to wait for the killed process tree's pipe to close.
KILL_GRACE_S = 2.0
TAIL_BYTES = 4096  # the end of the output kept besides its start, to tell a MemoryError
# Run once per process: threads, a file in the working directory, the output.
PROBE = ("import threading\nopen('probe.txt', 'w').write('sandbox ok')\n"
         "thread = threading.Thread(target=lambda: print(open('probe.txt').read()))\nthread.start()\nthread.join()")


@dataclass(frozen=True)
class SandboxResult:
    """What one run did.

    ``status``: ``"ok"`` (exit status 0), ``"error"`` (another exit status),
    ``"timeout"`` (killed past ``timeout_s``), ``"cpu_limit"`` (killed past
    ``cpu_time_s``), ``"memory"`` (ended by a ``MemoryError``, i.e. ``memory_bytes``),
    ``"killed"`` (ended by another signal) or ``"setup_failed"`` (the sandbox could not be
    set up; the program never ran: ``output`` says why). ``exit_code``: the program's exit
    status, ``128 + n`` for signal ``n``, None on a timeout. ``output``: stdout and stderr
    interleaved, at most ``max_output_bytes`` of it (``output_truncated`` when there was
    more). ``report``: the program's ``REPORT_FILE`` as it left it, at most
    ``max_output_bytes`` of it, or None when it left none (or timed out).
    """

    status: Status
    exit_code: int | None
    output: str
    output_truncated: bool
    report: str | None
    duration_s: float


def run_python(program: str, limits: SandboxLimits | None = None, files: dict[str, str] | None = None) -> SandboxResult:
    """Run the Python source ``program`` under ``limits`` (the defaults of
    ``SandboxLimits``), with ``files`` (name -> text) written beside it in its working
    directory first. Raises ``SandboxUnavailable`` where namespaces cannot be made, unless
    ``limits.allow_unisolated``; ``ValueError`` for a bad file name or given files that do
    not fit ``max_disk_bytes`` or ``max_files``; never for anything the program does."""
    limits = limits or SandboxLimits()
    files = files or {}
    for name in files:
        if not isinstance(name, str) or name in ("", ".", "..", PROGRAM_FILE) or "/" in name or "\0" in name:
            raise ValueError(f"run_python: files[{name!r}]: a file name must be a plain name in the working "
                             f"directory (no '/'), other than {PROGRAM_FILE!r}")
    given_bytes = sum(len(text.encode("utf-8")) for text in (program, *files.values()))
    if given_bytes > limits.max_disk_bytes or len(files) + 1 > limits.max_files:
        raise ValueError(f"run_python: the program and its {len(files)} files ({given_bytes} bytes) do not fit its "
                         f"working directory: SandboxLimits.max_disk_bytes = {limits.max_disk_bytes}, "
                         f"max_files = {limits.max_files}")
    problem = namespaces_problem()
    if problem is not None:
        if not limits.allow_unisolated:
            raise SandboxUnavailable(
                f"{problem}. The sandbox does not run untrusted code without its namespaces (no network, no view of "
                "the host's files, own process tree); fix that, or pass SandboxLimits(allow_unisolated=True) to run "
                "programs with network and filesystem access")
        _warn_unisolated(problem)
    unbounded = threads_problem(namespaces=problem is None)
    if unbounded is not None:
        _warn_threads(unbounded)
    return _run(program, limits, files, namespaces=problem is None)


@functools.cache
def namespaces_problem() -> str | None:
    """Why programs cannot run in new namespaces here (what the probe found), or None when
    they can. The probe, a small program (a thread, a file) run the real way, runs once
    per process."""
    try:
        result = _run(PROBE, SandboxLimits(timeout_s=60.0), {}, namespaces=True)
    except SandboxUnavailable as error:
        return str(error)
    except (OSError, subprocess.SubprocessError) as error:
        return f"the sandbox could not start `unshare`: {type(error).__name__}: {error}"
    if result.status != "ok" or result.output.strip() != "sandbox ok":
        output = result.output.strip()[-500:]
        return (f"the sandbox's probe in new namespaces (`unshare {' '.join(isolation.NAMESPACES)}`) ended with "
                f"status {result.status!r}, exit code {result.exit_code}: {output}")
    return None


def threads_problem(namespaces: bool) -> str | None:
    """Why ``max_threads`` cannot be enforced here, or None when it is: by a pids cgroup
    (``cgroups``), else by ``RLIMIT_NPROC`` in the sandbox's user namespace, which the
    kernel applies only to users other than the host's root, and per namespace only from
    Linux 5.14."""
    if cgroups.parent() is not None:
        return None
    if not namespaces:
        return "no pids cgroup can be made, and without namespaces RLIMIT_NPROC would count all the user's tasks"
    if os.geteuid() == 0:
        return "no pids cgroup can be made, and the kernel does not apply RLIMIT_NPROC to root"
    if not threads_counted_per_namespace():
        return (f"no pids cgroup can be made, and this kernel ({platform.release()}) counts RLIMIT_NPROC over all "
                "the user's tasks, not per user namespace (Linux 5.14 on)")
    return None


@functools.cache
def threads_counted_per_namespace() -> bool:
    """Whether ``RLIMIT_NPROC`` counts a user's tasks per user namespace (Linux 5.14 on);
    before, it counts all of the user's tasks on the host, the trainer's threads too."""
    numbers = re.match(r"(\d+)\.(\d+)", platform.release())
    return numbers is not None and (int(numbers[1]), int(numbers[2])) >= (5, 14)


@functools.cache
def _warn_unisolated(problem: str) -> None:
    warnings.warn(f"sandbox: {problem}; running untrusted programs WITHOUT network and filesystem isolation "
                  "because SandboxLimits.allow_unisolated is set", SandboxWarning, stacklevel=3)


@functools.cache
def _warn_threads(problem: str) -> None:
    warnings.warn(f"sandbox: SandboxLimits.max_threads is not enforced here ({problem}); a program's threads are "
                  "bounded only by its address space", SandboxWarning, stacklevel=3)


def _run(program: str, limits: SandboxLimits, files: dict[str, str], *, namespaces: bool) -> SandboxResult:
    cgroup_parent = cgroups.parent()
    try:  # + 1: the launcher, which the cgroup also holds
        cgroup = cgroups.make(cgroup_parent, limits.max_threads + 1) if cgroup_parent is not None else None
    except OSError as error:
        return SandboxResult("setup_failed", launcher.SETUP_FAILED, f"{launcher.SETUP_MESSAGE}making the run's pids "
                             f"cgroup under {cgroup_parent}: {error}", False, None, 0.0)
    with contextlib.ExitStack() as cleanup:
        if cgroup is not None:
            cleanup.callback(cgroups.remove, cgroup)
        given = {**files, PROGRAM_FILE: program}
        directory = workdir.make(given)
        cleanup.callback(workdir.remove, directory)
        environment = {"PATH": ENVIRONMENT_PATH, "LANG": "C.UTF-8", "HOME": directory, "TMPDIR": directory}
        machine, setpriv = isolation.machine(), isolation.tool("setpriv")
        report_pipe, report_end = os.pipe()
        cleanup.callback(os.close, report_pipe)
        settings = {
            "workdir": directory, "program": PROGRAM_FILE, "files": sorted(given), "namespaces": namespaces,
            "machine": machine, "setpriv": setpriv, "environment": environment,
            "drop_capabilities": namespaces or os.geteuid() == 0, "rlimits": _rlimits(limits, namespaces),
            "seccomp_filter": seccomp.filter_program(machine).hex(), "cgroup": cgroup and str(cgroup),
            "disk": {"bytes": limits.max_disk_bytes, "files": limits.max_files},
            "view": view.filesystem(isolation.interpreter(), setpriv) if namespaces else None,
            "report_pipe": report_end, "report_file": REPORT_FILE, "report_bytes": limits.max_output_bytes,
        }
        started = time.monotonic()
        try:
            process = subprocess.Popen(isolation.command(json.dumps(settings), namespaces), stdin=subprocess.DEVNULL,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=environment,
                                       cwd=directory, start_new_session=True, pass_fds=(report_end,))
        finally:
            os.close(report_end)  # only the launcher writes the report
        with process:
            pipes = _read_pipes(process, report_pipe, limits.timeout_s, limits.max_output_bytes)
            exit_code = _wait(process)
        duration = time.monotonic() - started
    output = pipes.head.decode("utf-8", errors="replace")
    status = "timeout" if pipes.timed_out else _status(exit_code, output, pipes.tail)
    report = None
    if not pipes.timed_out and pipes.report.startswith(launcher.REPORT_MARKER):
        report = pipes.report[len(launcher.REPORT_MARKER):].decode("utf-8", errors="replace")
    return SandboxResult(status, None if pipes.timed_out else exit_code, output, pipes.truncated, report, duration)


def _rlimits(limits: SandboxLimits, namespaces: bool) -> dict[str, tuple[int, int]]:
    # CPU: the soft limit's SIGXCPU ends the program; the hard one (a second later) backs it.
    rlimits = {"RLIMIT_CPU": (limits.cpu_time_s, limits.cpu_time_s + 1),
               "RLIMIT_AS": (limits.memory_bytes, limits.memory_bytes),
               "RLIMIT_FSIZE": (limits.max_file_bytes, limits.max_file_bytes),
               "RLIMIT_NOFILE": (OPEN_FILES, OPEN_FILES), "RLIMIT_CORE": (0, 0)}
    if namespaces and threads_counted_per_namespace():
        # Counted per user and user namespace: `unshare` (it made the namespace and stays in
        # it), the launcher and the program's threads. The kernel ignores it for the host's
        # root: see threads_problem.
        rlimits["RLIMIT_NPROC"] = (limits.max_threads + 2, limits.max_threads + 2)
    return rlimits


@dataclass
class _Pipes:
    head: bytearray = field(default_factory=bytearray)  # the output's start, up to the limit
    tail: bytes = b""  # its end, to tell a MemoryError
    seen: int = 0
    report: bytes = b""
    timed_out: bool = False

    @property
    def truncated(self) -> bool:
        return self.seen > len(self.head)


def _read_pipes(process: subprocess.Popen, report_pipe: int, timeout_s: float, keep: int) -> _Pipes:
    """Read the output and the report pipes until every process holding them is gone,
    keeping ``keep`` bytes of each. Past ``timeout_s`` the process group is killed; past
    the grace after that, reading stops."""
    pipes = _Pipes()
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout.fileno(), selectors.EVENT_READ, "output")
        selector.register(report_pipe, selectors.EVENT_READ, "report")
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if pipes.timed_out:
                    break
                _kill(process)
                pipes.timed_out, deadline = True, time.monotonic() + KILL_GRACE_S
                continue
            for key, _ in selector.select(remaining):
                chunk = os.read(key.fd, 2**16)
                if not chunk:
                    selector.unregister(key.fd)
                elif key.data == "report":
                    pipes.report = (pipes.report + chunk)[: len(launcher.REPORT_MARKER) + keep]
                else:
                    pipes.seen += len(chunk)
                    pipes.head += chunk[: max(0, keep - len(pipes.head))]
                    pipes.tail = (pipes.tail + chunk)[-TAIL_BYTES:]
    return pipes


def _wait(process: subprocess.Popen) -> int:
    try:
        return process.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        _kill(process)
        return process.wait()


def _kill(process: subprocess.Popen) -> None:
    """SIGKILL the session's process group (``start_new_session``: its id is the first
    process's); ``unshare --kill-child`` takes the namespace's process 1, and the kernel
    every process left in the namespace with it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _status(exit_code: int, output: str, tail: bytes) -> Status:
    if exit_code == 0:
        return "ok"
    if exit_code == launcher.SETUP_FAILED and output.startswith(launcher.SETUP_MESSAGE):
        return "setup_failed"
    if exit_code in (128 + signal.SIGXCPU, -signal.SIGXCPU):
        return "cpu_limit"
    if exit_code == 1 and tail.strip().rsplit(b"\n", 1)[-1].startswith(b"MemoryError"):
        return "memory"
    return "killed" if exit_code > 128 or exit_code < 0 else "error"
