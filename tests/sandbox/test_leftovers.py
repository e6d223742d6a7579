"""What a process killed mid-run leaves (its runs' pids cgroups and working directories)
is removed by the next process to use the sandbox; a live process's, or another PID
namespace's, is kept."""

import os
import subprocess
import sys
import tempfile

import pytest

from lightning_logra.sandbox import cgroups, leftovers, workdir

PARENT = cgroups.parent()


def dead_pid() -> int:
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(finished.stdout)


@pytest.mark.skipif(PARENT is None, reason="no pids cgroup can be made here")
def test_the_cgroups_of_dead_processes_are_removed_at_the_first_run():
    dead = PARENT / f"{cgroups.PREFIX}{leftovers.tag(dead_pid())}leftover"
    alive = PARENT / f"{cgroups.PREFIX}{leftovers.tag()}running"
    dead.mkdir()
    alive.mkdir()
    try:
        cgroups.parent.cache_clear()
        assert cgroups.parent() == PARENT
        assert not dead.exists() and alive.exists()
    finally:
        for cgroup in (dead, alive):
            if cgroup.exists():
                cgroup.rmdir()


def test_the_working_directories_of_dead_processes_are_removed_at_the_first_run(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = tmp_path / f"{workdir.PREFIX}{leftovers.tag(dead_pid())}leftover"
    alive = tmp_path / f"{workdir.PREFIX}{leftovers.tag()}running"
    elsewhere = tmp_path / f"{workdir.PREFIX}1-{dead_pid()}-another-namespace"
    for directory in (dead / "deep" / "deeper", alive, elsewhere):
        directory.mkdir(parents=True)
    (dead / "deep" / "program.py").write_text("print(1)")
    workdir.remove_stale.cache_clear()
    made = workdir.make({"program.py": "print(1)"})
    assert not dead.exists() and alive.exists() and elsewhere.exists()
    assert os.path.basename(made).startswith(f"{workdir.PREFIX}{leftovers.tag()}")
    workdir.remove(made)
