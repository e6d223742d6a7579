"""Names that say which process made a run's working directory or pids cgroup, so that a
later process can remove those of a process that died mid-run (a reward worker killed at
its timeout runs no cleanup).

A name holds the PID namespace's inode and the process id: a process id is only checked
in the namespace it belongs to (a temporary directory shared by containers holds other
namespaces' names, which are left alone).
"""

from __future__ import annotations

import functools
import os
import re


@functools.cache
def _namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


def tag(pid: int | None = None) -> str:
    """A process's part of a name (this process's by default): ``<pid namespace>-<pid>-``."""
    return f"{_namespace()}-{os.getpid() if pid is None else pid}-"


def is_stale(name: str, prefix: str) -> bool:
    """Whether ``name`` (``prefix`` then a tag) was made by a process of this PID
    namespace that is no longer alive."""
    match = re.fullmatch(rf"{re.escape(prefix)}(\d+)-(\d+)-.*", name)
    if match is None or match[1] != _namespace():
        return False
    try:
        os.kill(int(match[2]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
