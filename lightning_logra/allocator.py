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

Below the threshold the heap still grew: on 2 ranks its extent rose by 0.25 GiB over one
backward while the bytes in use stayed flat (``fit_memory``'s accounts). Small freed blocks
parked in glibc's per-thread cache (tcache) and fast bins count as in use, so the large
blocks freed around them cannot merge, and every layer's activations land on fresh pages.
With both off the heap stays flat (each of 2 ranks: 1.78 GiB against 1.9-2.05). The fast
bins go off through ``mallopt`` at any time; the cache only through ``GLIBC_TUNABLES`` at a
process's start, so ``tune_glibc_malloc`` adds it to the environment of later processes
and ``restart_with_tuned_malloc`` starts the process again with it: the ``logra`` command
does so before it imports the library (``lightning_logra_command``), which a restart from
inside it would import twice (+5 s on 2 cores).
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

OPT_OUT = "LIGHTNING_LOGRA_MALLOC_TUNING"
# Environment variable -> (mallopt parameter number in glibc's malloc.h, value).
SETTINGS = {"MALLOC_MMAP_THRESHOLD_": (-3, 4 * 2**20), "MALLOC_ARENA_MAX": (-8, 2)}
M_MXFAST = 1  # mallopt's fast-bin limit; 0 turns the fast bins off
TUNABLES = "GLIBC_TUNABLES"
TCACHE, FAST_BINS = "glibc.malloc.tcache_count", "glibc.malloc.mxfast"
SMALL_BLOCK_CACHES_OFF = {TCACHE: "0", FAST_BINS: "0"}  # GLIBC_TUNABLES entries, name -> value
# What this process started with: glibc read it then, and never reads it again.
_STARTED_WITH = os.environ.get(TUNABLES, "")


def _applies() -> bool:
    return os.environ.get(OPT_OUT) != "0" and platform.libc_ver()[0] == "glibc"


def _tunable_set(tunables: str, name: str) -> bool:
    return any(entry.split("=", 1)[0] == name for entry in tunables.split(":") if entry)


def tune_glibc_malloc() -> dict[str, int | str]:
    """Apply ``SETTINGS`` and turn off the small-block caches where glibc is the C library
    and neither the user nor an earlier call set them; returns what this call set."""
    if not _applies():
        return {}
    libc = ctypes.CDLL(None)
    applied: dict[str, int | str] = {}
    for variable, (parameter, value) in SETTINGS.items():
        if variable in os.environ:
            continue
        if libc.mallopt(parameter, value) == 1:  # 1: accepted
            os.environ[variable] = str(value)
            applied[variable] = value
    tunables = os.environ.get(TUNABLES, "")
    missing = {name: value for name, value in SMALL_BLOCK_CACHES_OFF.items() if not _tunable_set(tunables, name)}
    if missing:
        if FAST_BINS in missing:
            libc.mallopt(M_MXFAST, 0)  # here and now; the cache only at the next start
        entries = [tunables] if tunables else []  # the user's own entries first, kept
        os.environ[TUNABLES] = ":".join([*entries, *(f"{name}={value}" for name, value in missing.items())])
        applied[TUNABLES] = os.environ[TUNABLES]
    return applied


def restart_with_tuned_malloc() -> None:
    """Start this command again (same process id, arguments and environment) where it
    began with glibc's small-block cache on, so that it runs with the tuning's
    ``GLIBC_TUNABLES``; returns where nothing needs it. Call it first thing in a command's
    entry point, never in a process that holds anything: ``exec`` replaces the process."""
    if not _applies() or _tunable_set(_STARTED_WITH, TCACHE):
        return
    tune_glibc_malloc()  # the environment the restarted process starts with (TCACHE now in it)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, sys.orig_argv)
