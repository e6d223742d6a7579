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
    """

    timeout_s: float = 5.0
    cpu_time_s: int = 5
    memory_bytes: int = 512 * 2**20
    max_file_bytes: int = 2**20
    max_output_bytes: int = 64 * 2**10
    allow_unisolated: bool = False

    def __post_init__(self) -> None:
        check = FieldChecks.of(self)
        check.number("timeout_s", above=0.0, at_most=3600.0)
        check.integer("cpu_time_s", at_least=1, at_most=3600)
        # Below about 64 MiB the interpreter itself cannot start.
        check.integer("memory_bytes", at_least=64 * 2**20)
        check.integer("max_file_bytes", at_least=0)
        check.integer("max_output_bytes", at_least=1)
        check.boolean("allow_unisolated")
