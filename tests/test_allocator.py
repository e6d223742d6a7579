"""The allocator tuning of lightning_logra.allocator, in fresh processes (it changes the
process's malloc and environment): applied once where glibc is the C library, never over
the user's own setting, and off on request; a command started with glibc's small-block
cache on restarts itself once with it off, the ``logra`` command before it imports the library."""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_logra.allocator import OPT_OUT, SETTINGS, TUNABLES

# The module loaded from its file, as the ``logra`` command loads it: the package's own
# import (about 5 s) would be paid per process.
LOAD = "from lightning_logra_command import load_allocator; allocator = load_allocator(); "
CALL = (LOAD + "import json, os; first = allocator.tune_glibc_malloc(); "
        "print(json.dumps([first, allocator.tune_glibc_malloc(), os.environ.get('MALLOC_MMAP_THRESHOLD_'), "
        "os.environ.get('MALLOC_ARENA_MAX'), os.environ.get('GLIBC_TUNABLES')]))")
RESTART = ("import os; print('started with', os.environ.get('GLIBC_TUNABLES'), flush=True); "
           + LOAD + "allocator.restart_with_tuned_malloc(); "
           "print('running with', os.environ.get('GLIBC_TUNABLES'))")
NO_CACHES = "glibc.malloc.tcache_count=0:glibc.malloc.mxfast=0"
ONLY_GLIBC = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the tuning applies where glibc is the C library")


def untuned(**environment) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k not in {*SETTINGS, OPT_OUT, TUNABLES}}, **environment}


def run(code: str, **environment) -> str:
    return subprocess.run([sys.executable, "-c", code], env=untuned(**environment), capture_output=True, text=True,
                          check=True).stdout


def call(**environment) -> list:
    import json

    return json.loads(run(CALL, **environment))


@ONLY_GLIBC
def test_the_tuning_is_applied_once_and_inherited_by_later_processes():
    first, second, threshold, arenas, tunables = call()
    assert first == {"MALLOC_MMAP_THRESHOLD_": 4194304, "MALLOC_ARENA_MAX": 2, "GLIBC_TUNABLES": NO_CACHES}
    assert second == {}
    assert (threshold, arenas, tunables) == ("4194304", "2", NO_CACHES)  # what ranks started later read at their start


@ONLY_GLIBC
def test_the_users_own_setting_wins_and_the_tuning_can_be_turned_off():
    first, _, threshold, arenas, tunables = call(MALLOC_ARENA_MAX="8", GLIBC_TUNABLES="glibc.malloc.tcache_count=3")
    assert first == {"MALLOC_MMAP_THRESHOLD_": 4194304, "GLIBC_TUNABLES": "glibc.malloc.tcache_count=3:glibc.malloc.mxfast=0"}
    assert (threshold, arenas, tunables) == ("4194304", "8", "glibc.malloc.tcache_count=3:glibc.malloc.mxfast=0")
    assert call(LIGHTNING_LOGRA_MALLOC_TUNING="0") == [{}, {}, None, None, None]


@ONLY_GLIBC
def test_a_command_started_with_the_cache_on_restarts_once_with_it_off():
    assert run(RESTART).splitlines() == ["started with None", f"started with {NO_CACHES}", f"running with {NO_CACHES}"]


@ONLY_GLIBC
def test_no_restart_where_the_user_set_the_cache_or_turned_the_tuning_off():
    assert run(RESTART, GLIBC_TUNABLES="glibc.malloc.tcache_count=7").splitlines() == [
        "started with glibc.malloc.tcache_count=7", "running with glibc.malloc.tcache_count=7"]
    assert run(RESTART, LIGHTNING_LOGRA_MALLOC_TUNING="0").splitlines() == ["started with None", "running with None"]


@ONLY_GLIBC
def test_the_logra_command_restarts_before_it_imports_the_library():
    # Python's import-time report names each module imported, per process: the restart
    # shows as the entry module imported twice; the library (about 5 s) must be imported once.
    command = [str(Path(sys.executable).parent / "logra"), "--help"]
    report = subprocess.run(command, env=untuned(PYTHONPROFILEIMPORTTIME="1"), capture_output=True, text=True,
                            check=True).stderr
    imported = [line.rsplit("|", 1)[1].strip() for line in report.splitlines() if line.startswith("import time:")]
    assert imported.count("lightning_logra_command") == 2
    assert imported.count("lightning_logra") == 1
