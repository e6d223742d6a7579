"""A pids cgroup per sandboxed run, where the trainer may make one: the kernel then
refuses the program's threads past ``SandboxLimits.max_threads``.

It is what bounds threads when the trainer runs as root: the kernel never applies
``RLIMIT_NPROC`` to a task whose real user is the host's root, capabilities or not (the
sandbox's user namespace maps its root to the trainer's user). The cgroup is made under
the trainer's own pids cgroup (cgroup v1's ``pids`` hierarchy, or cgroup v2 where the
trainer's cgroup already hands ``pids`` to its children); the launcher moves itself in
before it starts the program, and the run removes it afterwards.
"""

from __future__ import annotations

import functools
import re
import time
import uuid
import warnings
from pathlib import Path

from lightning_logra.sandbox import leftovers
from lightning_logra.sandbox.isolation import SandboxWarning

PREFIX = "logra-sandbox-"
# Seconds to wait for the killed tasks to leave a cgroup before giving up on removing it.
REMOVE_GRACE_S = 2.0


@functools.cache
def parent() -> Path | None:
    """The directory under which a run's pids cgroup can be made, or None where none can
    (no pids controller, or not allowed to make a cgroup there). Checked once per process
    by making and removing one; the cgroups left by processes that died mid-run (a reward
    worker killed at its timeout) are removed then."""
    for directory in _candidates():
        try:
            probe = make(directory, 2)
        except OSError:
            continue
        remove(probe)
        _remove_stale(directory)
        return directory
    return None


def make(under: Path, max_tasks: int) -> Path:
    """A new cgroup under ``under`` that admits at most ``max_tasks`` tasks."""
    cgroup = under / f"{PREFIX}{leftovers.tag()}{uuid.uuid4().hex[:12]}"
    cgroup.mkdir()
    try:
        (cgroup / "pids.max").write_text(str(max_tasks), encoding="ascii")
    except OSError:
        cgroup.rmdir()
        raise
    return cgroup


def remove(cgroup: Path) -> None:
    """Remove a run's cgroup once its tasks are gone (a killed process tree leaves it a
    moment later); warns, naming it, when it cannot."""
    deadline = time.monotonic() + REMOVE_GRACE_S
    while True:
        try:
            cgroup.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as error:
            if time.monotonic() > deadline:
                warnings.warn(f"sandbox: could not remove the run's pids cgroup {cgroup}: {error}", SandboxWarning,
                              stacklevel=2)
                return
            time.sleep(0.01)


def _remove_stale(directory: Path) -> None:
    """Remove the (empty: their tasks are gone) cgroups of processes no longer alive."""
    for cgroup in directory.glob(f"{PREFIX}*"):
        if leftovers.is_stale(cgroup.name, PREFIX):
            try:
                cgroup.rmdir()
            except OSError:
                pass  # still holding a task, or removed by another process meanwhile


def _candidates() -> list[Path]:
    """The trainer's pids cgroup directories: v1's, then v2's where it delegates pids."""
    try:
        mountinfo = Path("/proc/self/mountinfo").read_text(encoding="utf-8").splitlines()
        memberships = Path("/proc/self/cgroup").read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    mounts = []  # (is v2, super options, mount root, mount point)
    for line in mountinfo:
        before, _, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            mounts.append((tail[0] == "cgroup2", tail[2].split(","), _unescape(fields[3]), _unescape(fields[4])))
    found = []
    for line in memberships:
        _, controllers, path = line.split(":", 2)
        for is_v2, options, root, point in mounts:
            wanted = controllers == "" if is_v2 else "pids" in controllers.split(",") and "pids" in options
            if wanted and (path == root or path.startswith(root.rstrip("/") + "/")):
                directory = Path(point, path[len(root):].lstrip("/"))
                if not is_v2 or "pids" in _read(directory / "cgroup.subtree_control").split():
                    found.append((is_v2, directory))
    return [directory for _, directory in sorted(found, key=lambda item: item[0])]


def _unescape(field: str) -> str:
    """A mountinfo path: a space, tab, newline or backslash in it is an octal escape."""
    return re.sub(r"\\([0-7]{3})", lambda code: chr(int(code[1], 8)), field)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="ascii")
    except OSError:
        return ""
