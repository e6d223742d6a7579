"""Run one untrusted Python program in the sandbox and say what happened.

The program runs in a fresh interpreter (``-I -S``: no site-packages, no environment
variables read, no user directories), never in the calling process, started as its own
session in new namespaces (see ``isolation`` and ``launcher``) in an empty temporary
working directory that is removed afterwards, with a fixed environment (``PATH``, ``LANG``,
``HOME`` and ``TMPDIR`` the working directory: none of the caller's variables). Its stdout
and stderr are read together up to ``max_output_bytes``; the rest is read and discarded.
Past ``timeout_s`` the whole process group is killed, and the namespace's process 1 with
it, which takes every process left in the namespace.
"""

from __future__ import annotations

import functools
import json
import os
import selectors
import signal
import stat
import subprocess
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from lightning_logra.sandbox import isolation, launcher
from lightning_logra.sandbox.isolation import SandboxUnavailable
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


class SandboxWarning(UserWarning):
    """The sandbox runs programs with less isolation than it should (an opt-out)."""


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
    more). ``report``: the program's ``REPORT_FILE``, or None when it left none.
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
    ``limits.allow_unisolated``; never for anything the program does."""
    limits = limits or SandboxLimits()
    for name in files or {}:
        if not isinstance(name, str) or name in ("", ".", "..", PROGRAM_FILE) or "/" in name or "\0" in name:
            raise ValueError(f"run_python: files[{name!r}]: a file name must be a plain name in the working "
                             f"directory (no '/'), other than {PROGRAM_FILE!r}")
    problem = namespaces_problem()
    if problem is not None:
        if not limits.allow_unisolated:
            raise SandboxUnavailable(
                f"{problem}. The sandbox does not run untrusted code without its namespaces (no network, read-only "
                "filesystem, own process tree); fix that, or pass SandboxLimits(allow_unisolated=True) to run "
                "programs with network and filesystem access")
        _warn_unisolated(problem)
    return _run(program, limits, files or {}, namespaces=problem is None)


@functools.cache
def namespaces_problem() -> str | None:
    """Why programs cannot run in new namespaces here (what the probe found), or None when
    they can. The probe, a trivial program run the real way, runs once per process."""
    try:
        result = _run("print('sandbox ok')", SandboxLimits(timeout_s=60.0), {}, namespaces=True)
    except SandboxUnavailable as error:
        return str(error)
    except (OSError, subprocess.SubprocessError) as error:
        return f"the sandbox could not start `unshare`: {type(error).__name__}: {error}"
    if result.status != "ok" or result.output.strip() != "sandbox ok":
        output = result.output.strip()[-500:]
        return (f"the sandbox's probe in new namespaces (`unshare {' '.join(isolation.NAMESPACES)}`) ended with "
                f"status {result.status!r}, exit code {result.exit_code}: {output}")
    return None


@functools.cache
def _warn_unisolated(problem: str) -> None:
    warnings.warn(f"sandbox: {problem}; running untrusted programs WITHOUT network and filesystem isolation "
                  "because SandboxLimits.allow_unisolated is set", SandboxWarning, stacklevel=3)


def _run(program: str, limits: SandboxLimits, files: dict[str, str], *, namespaces: bool) -> SandboxResult:
    with tempfile.TemporaryDirectory(prefix="logra-sandbox-") as workdir:
        workdir = os.path.realpath(workdir)
        for name, text in {**files, PROGRAM_FILE: program}.items():
            Path(workdir, name).write_text(text, encoding="utf-8")
        environment = {"PATH": ENVIRONMENT_PATH, "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}
        settings = {
            "workdir": workdir, "program": PROGRAM_FILE, "namespaces": namespaces, "machine": isolation.machine(),
            "setpriv": isolation.tool("setpriv"), "environment": environment,
            "drop_capabilities": namespaces or os.geteuid() == 0, "rlimits": _rlimits(limits),
        }
        started = time.monotonic()
        process = subprocess.Popen(isolation.command(json.dumps(settings), namespaces), stdin=subprocess.DEVNULL,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=environment, cwd=workdir,
                                   start_new_session=True)
        with process:
            head, tail, truncated, timed_out = _read_output(process, limits.timeout_s, limits.max_output_bytes)
            exit_code = _wait(process)
        duration = time.monotonic() - started
        report = _read_report(Path(workdir, REPORT_FILE), limits.max_output_bytes)
    output = head.decode("utf-8", errors="replace")
    status = "timeout" if timed_out else _status(exit_code, output, tail)
    return SandboxResult(status, None if timed_out else exit_code, output, truncated, report, duration)


def _rlimits(limits: SandboxLimits) -> dict[str, tuple[int, int]]:
    # CPU: the soft limit's SIGXCPU ends the program; the hard one (a second later) backs it.
    return {"RLIMIT_CPU": (limits.cpu_time_s, limits.cpu_time_s + 1),
            "RLIMIT_AS": (limits.memory_bytes, limits.memory_bytes),
            "RLIMIT_FSIZE": (limits.max_file_bytes, limits.max_file_bytes),
            "RLIMIT_NOFILE": (OPEN_FILES, OPEN_FILES), "RLIMIT_CORE": (0, 0)}


def _read_output(process: subprocess.Popen, timeout_s: float, keep: int) -> tuple[bytes, bytes, bool, bool]:
    """Read the pipe until every process holding it is gone: ``(start, end, truncated,
    timed_out)``. Past ``timeout_s`` the process group is killed; past the grace after
    that, reading stops."""
    head, tail, seen, timed_out = bytearray(), b"", 0, False
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if timed_out:
                    break
                _kill(process)
                timed_out, deadline = True, time.monotonic() + KILL_GRACE_S
                continue
            if not selector.select(remaining):
                continue
            chunk = os.read(process.stdout.fileno(), 2**16)
            if not chunk:
                break
            seen += len(chunk)
            head += chunk[: max(0, keep - len(head))]
            tail = (tail + chunk)[-TAIL_BYTES:]
    return bytes(head), tail, seen > keep, timed_out


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


def _read_report(path: Path, limit: int) -> str | None:
    """The report's start; never through a link (the program could point one anywhere)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(descriptor, "rb") as report:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            return None
        return report.read(limit).decode("utf-8", errors="replace")
