"""One writer per checkpoint folder: ``.logra-writer.lock``, a lease renewed by a heartbeat.

The lock file holds its owner (pid, host), when it last renewed the lease (Unix time) and
the lease length. Every read and write of it happens under ``flock`` on the file itself,
so that checking a holder and replacing it is one atomic step: of two runs that find the
same stale lock, exactly one takes it over. A released lock is deleted while still
flocked; whoever was waiting for it sees that the file it locked is no longer the one at
that path and starts again.

A holder is gone, and its lock taken over with a warning naming it, when its process no
longer runs on this host, or when it has not renewed its lease for longer than the lease
(any host: a run killed on one node and requeued on another). A lock held on another
host whose lease has not run out is waited for: renewed meanwhile, the run is refused;
not renewed, it is taken over when the lease runs out. The hosts' clocks must agree to
well within a lease (NTP does).

A process holds each folder once (``hold``): the CLI claims its folders before Lightning
resolves ``ckpt_path``, the strategy claims them again in its setup, and whichever ends
first releases them (``release``; ``atexit`` for whatever is left).
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn

LOCK_NAME = ".logra-writer.lock"
DEFAULT_LEASE_S = 600.0
MIN_LEASE_S = 10.0  # renewed every lease / 3: a slow shared filesystem must not lose a live run's lock
POLL_S = 1.0  # how often a run waiting for another host's lease reads the lock again
NO_FLOCK = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP)

Result = TypeVar("Result")


class FolderLocked(RuntimeError):
    """Another live run holds the folder's writer lock."""


class LostLock(RuntimeError):
    """This run's lock was taken over (its lease ran out while it did not renew it)."""


def check_lease(lease_s: Any, owner: str) -> float:
    """``lease_s`` as a float, or an error naming ``owner``'s field."""
    if isinstance(lease_s, bool) or not isinstance(lease_s, (int, float)) or not math.isfinite(lease_s) \
            or lease_s < MIN_LEASE_S:
        raise ValueError(f"{owner}.checkpoint_lock_lease_s = {lease_s!r} is invalid: must be a number of seconds "
                         f">= {MIN_LEASE_S:g} (default {DEFAULT_LEASE_S:g})")
    return float(lease_s)


class WriterLock:
    """The writer lock of ``folder``; ``acquire`` starts a daemon thread that renews the
    lease every ``lease_s / 3`` seconds until ``release``."""

    def __init__(self, folder: Path, lease_s: float = DEFAULT_LEASE_S) -> None:
        self.path = Path(folder) / LOCK_NAME
        self.lease_s = check_lease(lease_s, type(self).__name__)
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._lost: LostLock | None = None

    def acquire(self, *, wait: bool = True) -> None:
        """Take the lock; raise ``FolderLocked`` if another live run holds it. With
        ``wait=False`` another host's unexpired lease is refused instead of waited for."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        waited_for = None
        while True:
            with self._flocked() as lock:
                holder = _read(lock)
                verdict = self._judge(holder)
                if verdict == "refuse" or (verdict == "wait" and not wait):
                    raise FolderLocked(self._refusal(holder))
                if verdict == "wait" and waited_for is not None and holder["renewed_at"] != waited_for:
                    raise FolderLocked(self._refusal(holder, renewed_while_waiting=True))
                if verdict != "wait":
                    if verdict == "take over":
                        rank_zero_warn(f"taking over the writer lock of {self.path.parent}: {describe(holder)} "
                                       "is gone (its process is not running on this host, or its lease ran out)")
                    self._write(lock)
                    break
            if waited_for is None:
                waited_for = holder["renewed_at"]
                rank_zero_info(f"{self.path.parent} is locked by {describe(holder)}: waiting up to "
                               f"{_remaining(holder):.0f} s for that lease to run out "
                               "(a renewal means the run is live)")
            time.sleep(POLL_S)
        self._lost = None
        if self._heartbeat is not None:  # acquired again by its holder: one heartbeat is enough
            return
        self._stop.clear()
        self._heartbeat = threading.Thread(target=self._renew_until_released, name=f"logra-lease {self.path.parent}",
                                           daemon=True)
        self._heartbeat.start()

    def renew(self) -> None:
        """Renew the lease; raise ``LostLock`` (now and at every later call) if another run
        has taken the lock over."""
        if self._lost is not None:
            raise self._lost
        with self._flocked() as lock:
            holder = _read(lock)
            if holder is not None and not _is_mine(holder):  # None: deleted by hand, nobody took it
                self._lost = LostLock(
                    f"this run no longer holds the writer lock of {self.path.parent}: {describe(holder)} took it over "
                    f"after this run's lease of {self.lease_s:g} s ran out unrenewed (was the process stopped?); "
                    "it writes no checkpoint there any more"
                )
                raise self._lost
            self._write(lock)

    def release(self) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=10)
            self._heartbeat = None
        try:
            with self._flocked() as lock:
                holder = _read(lock)
                if holder is None or _is_mine(holder):  # None: the empty file this open created
                    self.path.unlink()
        except FileNotFoundError:  # the folder itself is gone
            pass

    def _renew_until_released(self) -> None:
        warned = False
        while not self._stop.wait(self.lease_s / 3):
            try:
                self.renew()
            except LostLock:
                return  # the next save raises it
            except OSError as error:  # a shared filesystem's hiccup: try again at the next beat
                if not warned:
                    rank_zero_warn(f"could not renew the writer lock {self.path}: {error}; retrying every "
                                   f"{self.lease_s / 3:.0f} s")
                    warned = True

    def _judge(self, holder: dict[str, Any] | None) -> str:
        """"take": free or ours; "take over": its holder is gone; "refuse": a live holder;
        "wait": another host's lease that has not run out yet."""
        if holder is None or _is_mine(holder):
            return "take"
        if not holder.get("readable", True):
            return "take over"
        remaining = _remaining(holder)
        if holder.get("host") == socket.gethostname():
            if not _is_running(holder.get("pid")):
                return "take over"
            # A live pid that let its lease run out is hung, or a reused pid; without a
            # lease (an earlier version's lock) the live pid decides.
            return "take over" if remaining is not None and remaining <= 0 else "refuse"
        if remaining is None or remaining <= 0:
            return "take over"
        return "wait"

    def _refusal(self, holder: dict[str, Any], renewed_while_waiting: bool = False) -> str:
        remaining = _remaining(holder)
        if renewed_while_waiting:
            why = "it renewed its lease while this run waited"
        elif holder.get("host") == socket.gethostname():
            why = "its process is running"
        else:
            why = f"its lease runs out in {remaining:.0f} s unless renewed"
        return (f"another run writes checkpoints into {self.path.parent}: {self.path} is held by {describe(holder)} "
                f"({why}); give this run another checkpoint folder (trainer.default_root_dir, ModelCheckpoint's "
                "dirpath), or delete the lock if that run is gone")

    def _write(self, lock: int) -> None:
        record = {**_me(), "renewed_at": time.time(), "lease_s": self.lease_s}
        data = json.dumps(record).encode()
        os.lseek(lock, 0, os.SEEK_SET)
        os.ftruncate(lock, 0)
        os.write(lock, data)
        os.fsync(lock)

    @contextmanager
    def _flocked(self) -> Iterator[int]:
        """The lock file, open and flocked, and still the file at its path (a release
        deletes it: whoever waited on the deleted file opens the path again)."""
        while True:
            descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX)
            except OSError as error:
                os.close(descriptor)
                if error.errno in NO_FLOCK:
                    raise RuntimeError(
                        f"the filesystem of {self.path.parent} does not support flock ({error.strerror}), which the "
                        "checkpoint writer lock needs to be atomic across runs; write checkpoints to a filesystem "
                        "that does (local disks, NFS, Lustre mounted with -o flock)"
                    ) from error
                raise
            if _is_linked(descriptor, self.path):
                break
            os.close(descriptor)
        try:
            yield descriptor
        finally:
            os.close(descriptor)  # releases the flock


def describe(holder: dict[str, Any]) -> str:
    """The holder as the warnings and errors name it."""
    if not holder.get("readable", True):
        return "an unreadable lock (its writer died writing it)"
    renewed = holder.get("renewed_at")
    when = "never renewed" if not isinstance(renewed, (int, float)) else \
        f"last renewed {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(renewed))}"
    return f"pid {holder.get('pid')} on {holder.get('host')!r} ({when})"


# -- One hold per folder and process --

_held: dict[Path, WriterLock] = {}
_held_guard = threading.Lock()


def hold(folder: Path, lease_s: float = DEFAULT_LEASE_S) -> WriterLock:
    """This process's lock of ``folder``, acquired (waiting for another host's lease)
    unless already held; raises ``FolderLocked`` if another live run holds it."""
    folder = Path(folder).absolute()
    with _held_guard:
        if folder not in _held:
            lock = WriterLock(folder, lease_s)
            lock.acquire()
            _held[folder] = lock
        return _held[folder]


def release(folder: Path) -> None:
    with _held_guard:
        lock = _held.pop(Path(folder).absolute(), None)
    if lock is not None:
        lock.release()


@atexit.register
def release_all() -> None:
    """Whatever a process still holds when it exits (a CLI run under a strategy that does
    not release them; a script that claimed folders and never fit)."""
    for folder in list(_held):
        release(folder)


def recover_if_free(folder: Path, recovery: Callable[[Path], Result]) -> Result | None:
    """``recovery(folder)`` under the folder's lock: this process's, or taken for the
    recovery only. A folder another live run holds is left alone (None): that run
    recovered it at its start, and what it is writing now must not be touched."""
    folder = Path(folder).absolute()
    if folder in _held:
        return recovery(folder)
    if not folder.is_dir():
        return None
    lock = WriterLock(folder)
    try:
        lock.acquire(wait=False)
    except FolderLocked:
        return None
    try:
        return recovery(folder)
    finally:
        lock.release()


def _me() -> dict[str, Any]:
    """Read at each use: a forked child is not the parent that took the lock."""
    return {"pid": os.getpid(), "host": socket.gethostname()}


def _is_mine(holder: dict[str, Any] | None) -> bool:
    return holder is not None and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname()


def _read(lock: int) -> dict[str, Any] | None:
    """The holder; None for a free (empty) lock; ``readable: False`` for one its writer
    died writing (every live writer writes under the flock, so no reader sees it half done)."""
    os.lseek(lock, 0, os.SEEK_SET)
    data = b""
    while chunk := os.read(lock, 65536):
        data += chunk
    if not data:
        return None
    try:
        holder = json.loads(data)
    except ValueError:
        return {"readable": False}
    return holder if isinstance(holder, dict) else {"readable": False}


def _remaining(holder: dict[str, Any]) -> float | None:
    """Seconds left of the holder's lease; None for a lock without one (an earlier version's)."""
    renewed, lease = holder.get("renewed_at"), holder.get("lease_s")
    if not isinstance(renewed, (int, float)) or not isinstance(lease, (int, float)):
        return None
    return renewed + lease - time.time()


def _is_running(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


def _is_linked(descriptor: int, path: Path) -> bool:
    try:
        return os.fstat(descriptor).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False
