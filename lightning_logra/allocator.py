"""glibc's allocator, tuned for RL steps on CPU ranks: freed tensors go back to the system.

With its defaults glibc keeps large freed blocks in per-thread arenas and raises its mmap
threshold as programs free big blocks, so a process's RSS keeps the high-water mark of
every phase of a step (loading, generation, forward and backward, the update) long after
the tensors are gone; with several ranks per machine each keeps its own. The issue 43
measurement: a 1-step ``logra fit`` of a 0.42B model peaked at 2.7 GiB on 1 process and 3.4
GiB per rank on 2; with ``MALLOC_MMAP_THRESHOLD_=65536 MALLOC_ARENA_MAX=2`` at 2.27 and
1.84-1.90 GiB. A 64 KiB threshold sends every activation-sized block to mmap, though, and
its page faults cost the quickstart 30-48% of its step time; at 4 MiB the step time is
glibc's (+0.1%) and each of 2 ranks still peaks about a fifth lower (2.02 GiB against 2.58;
``benchmarks/results/fit_memory.md`` has the sweep over thresholds). ``tune_glibc_malloc``
sets a 4 MiB threshold and two arenas through ``mallopt`` in this process and in the
environment that ranks started later inherit (glibc reads it at their start). A value the
user set in the environment is left as it is (``MALLOC_MMAP_THRESHOLD_=65536`` for the
tightest memory); ``LIGHTNING_LOGRA_MALLOC_TUNING=0`` turns the tuning off. Other C
libraries (musl, macOS) are left alone.
"""

from __future__ import annotations

import ctypes
import os
import platform

OPT_OUT = "LIGHTNING_LOGRA_MALLOC_TUNING"
# Environment variable -> (mallopt parameter number in glibc's malloc.h, value).
SETTINGS = {"MALLOC_MMAP_THRESHOLD_": (-3, 4 * 2**20), "MALLOC_ARENA_MAX": (-8, 2)}


def tune_glibc_malloc() -> dict[str, int]:
    """Apply ``SETTINGS`` where glibc is the C library and neither the user nor an earlier
    call set them; returns the variables this call set."""
    if os.environ.get(OPT_OUT) == "0" or platform.libc_ver()[0] != "glibc":
        return {}
    libc = ctypes.CDLL(None)
    applied = {}
    for variable, (parameter, value) in SETTINGS.items():
        if variable in os.environ:
            continue
        if libc.mallopt(parameter, value) == 1:  # 1: accepted
            os.environ[variable] = str(value)
            applied[variable] = value
    return applied
