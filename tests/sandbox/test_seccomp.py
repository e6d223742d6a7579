"""The seccomp allowlist's table: its numbers are the kernel's, and the filter fits."""

import re
from pathlib import Path

import pytest

from lightning_logra.sandbox import seccomp

X86_64_HEADER = Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h")
GENERIC_HEADER = Path("/usr/include/asm-generic/unistd.h")  # AArch64's numbering


def x86_64_numbers() -> dict[str, int]:
    return {match[1]: int(match[2]) for match in re.finditer(r"#define __NR_(\w+)\s+(\d+)", X86_64_HEADER.read_text())}


def aarch64_numbers() -> dict[str, int]:
    """The generic table as a 64-bit machine sees it: a few names are aliases of a
    ``__NR3264_`` number (``fcntl``, ``lseek``, ``mmap``, ``newfstatat``...)."""
    text = GENERIC_HEADER.read_text()
    numbers = {match[1]: int(match[2]) for match in re.finditer(r"#define __NR_(\w+)\s+(\d+)", text)}
    both = {match[1]: int(match[2]) for match in re.finditer(r"#define __NR3264_(\w+)\s+(\d+)", text)}
    sixty_four_bit = text[text.index("#if __BITS_PER_LONG == 64 && !defined(__SYSCALL_COMPAT)"):]
    for match in re.finditer(r"#define __NR_(\w+)\s+__NR3264_(\w+)", sixty_four_bit[:sixty_four_bit.index("#else")]):
        if match[2] in both:
            numbers[match[1]] = both[match[2]]
    return numbers


@pytest.mark.skipif(not (X86_64_HEADER.exists() and GENERIC_HEADER.exists()), reason="no kernel headers here")
def test_the_tables_numbers_are_the_kernel_headers():
    x86_64, aarch64 = x86_64_numbers(), aarch64_numbers()
    wrong = {name: (numbers, (x86_64.get(name), aarch64.get(name))) for name, numbers in seccomp.SYSCALLS.items()
             if numbers != (x86_64.get(name), aarch64.get(name))}
    assert wrong == {}


@pytest.mark.parametrize("machine", list(seccomp.MACHINES))
def test_the_filter_fits_and_names_no_escape(machine):
    program = seccomp.filter_program(machine)
    assert len(program) % 8 == 0 and len(program) // 8 <= 4096  # the kernel's BPF_MAXINSNS
    escapes = {"io_uring_setup", "io_uring_enter", "unshare", "setns", "bpf", "perf_event_open", "ptrace", "mount",
               "clone3", "socket", "fork"}
    assert escapes.isdisjoint(seccomp.allowed_names())
