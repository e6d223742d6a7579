"""The limits one sandboxed program runs under."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_logra.core.validation import FieldChecks


@dataclass(frozen=True)
class SandboxLimits:
    """What one program may use; past a limit it is stopped and the run says which.

    Args:
        timeout_s: wall-clock seconds from start to exit; past them the whole process
            tree is killed (``status == "timeout"``).
        cpu_time_s: CPU seconds (``RLIMIT_CPU``, whole seconds); past them the kernel
            kills the program (``status == "cpu_limit"``).
        memory_bytes: address space (``RLIMIT_AS``); past it an allocation fails, in
            Python a ``MemoryError`` (``status == "memory"``).
        max_file_bytes: the largest file the program may write (``RLIMIT_FSIZE``); a
            larger write fails (``EFBIG``).
        max_output_bytes: stdout and stderr together kept up to this many bytes, the rest
            read and discarded (``output_truncated``); also the most read back of the
            program's report file.
        allow_unisolated: where namespaces are unavailable, run anyway with the limits,
            the scrubbed environment and the empty working directory but with network and
            filesystem access (a warning says so); by default such a run is refused.
        max_disk_bytes: all the files in the working directory together, the program and
            the given files included (a tmpfs of this size); a write past it fails
            (``ENOSPC``). Unisolated runs have no such cap, only ``max_file_bytes``.
        max_files: files and directories in the working directory at once, the program
            and the given files included (the tmpfs's inodes); unisolated, no cap.
        max_threads: threads the program may run at once, its main thread included;
            past them starting a thread fails (``RuntimeError: can't start new thread``).
            Enforced by a pids cgroup where the trainer can make one, else by
            ``RLIMIT_NPROC`` (not for root; see ``runner.threads_problem``).
    """

    timeout_s: float = 5.0
    cpu_time_s: int = 5
    memory_bytes: int = 512 * 2**20
    max_file_bytes: int = 2**20
    max_output_bytes: int = 64 * 2**10
    allow_unisolated: bool = False
    max_disk_bytes: int = 16 * 2**20
    max_files: int = 1024
    max_threads: int = 64

    def __post_init__(self) -> None:
        check = FieldChecks.of(self)
        check.number("timeout_s", above=0.0, at_most=3600.0)
        check.integer("cpu_time_s", at_least=1, at_most=3600)
        # Below about 64 MiB the interpreter itself cannot start.
        check.integer("memory_bytes", at_least=64 * 2**20)
        check.integer("max_file_bytes", at_least=0)
        check.integer("max_output_bytes", at_least=1)
        check.boolean("allow_unisolated")
        check.integer("max_disk_bytes", at_least=2**16)
        check.integer("max_files", at_least=2)  # the program and its report
        check.integer("max_threads", at_least=1)
