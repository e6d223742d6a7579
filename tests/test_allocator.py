"""The allocator tuning of lightning_logra.allocator, in fresh processes (it changes the
process's malloc and environment): applied once where glibc is the C library, never over
the user's own setting, and off on request."""

import os
import platform
import subprocess
import sys

import pytest

CALL = ("import json, os; from lightning_logra.allocator import tune_glibc_malloc; first = tune_glibc_malloc(); "
        "print(json.dumps([first, tune_glibc_malloc(), os.environ.get('MALLOC_MMAP_THRESHOLD_'), "
        "os.environ.get('MALLOC_ARENA_MAX')]))")


def call(**environment) -> list:
    import json

    clean = {k: v for k, v in os.environ.items()
             if k not in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_ARENA_MAX", "LIGHTNING_LOGRA_MALLOC_TUNING")}
    run = subprocess.run([sys.executable, "-c", CALL], env={**clean, **environment}, capture_output=True, text=True,
                         check=True)
    return json.loads(run.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the tuning applies where glibc is the C library")
def test_the_tuning_is_applied_once_and_inherited_by_later_processes():
    first, second, threshold, arenas = call()
    assert first == {"MALLOC_MMAP_THRESHOLD_": 4194304, "MALLOC_ARENA_MAX": 2} and second == {}
    assert (threshold, arenas) == ("4194304", "2")  # what ranks started later read at their start


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the tuning applies where glibc is the C library")
def test_the_users_own_setting_wins_and_the_tuning_can_be_turned_off():
    first, _, threshold, arenas = call(MALLOC_ARENA_MAX="8")
    assert first == {"MALLOC_MMAP_THRESHOLD_": 4194304} and (threshold, arenas) == ("4194304", "8")
    assert call(LIGHTNING_LOGRA_MALLOC_TUNING="0") == [{}, {}, None, None]
