"""The host side of a run's working directory: made empty, given the program and its
files, and removed afterwards however the program left it.

In new namespaces the program works in a tmpfs the launcher mounts over this directory,
so the host directory only ever holds what the caller gave; run unisolated, the program
works in it directly and may leave anything there, which ``remove_tree`` still removes.
A process killed mid-run leaves its directories; the next process to make one removes
them (``leftovers``).
"""

from __future__ import annotations

import functools
import os
import stat
import tempfile
import warnings

from lightning_logra.sandbox import leftovers
from lightning_logra.sandbox.isolation import SandboxWarning

PREFIX = "logra-sandbox-"
DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


def make(files: dict[str, str]) -> str:
    """A new directory in the temporary directory, holding ``files`` (name -> text)."""
    remove_stale(tempfile.gettempdir())
    directory = os.path.realpath(tempfile.mkdtemp(prefix=PREFIX + leftovers.tag()))
    try:
        for name, text in files.items():
            with open(os.path.join(directory, name), "x", encoding="utf-8") as file:
                file.write(text)
    except BaseException:
        remove(directory)
        raise
    return directory


@functools.cache
def remove_stale(temporary: str) -> None:
    """Remove, once per process, the working directories that processes no longer alive
    left in ``temporary``."""
    try:
        names = os.listdir(temporary)
    except OSError:
        return
    for name in names:
        if leftovers.is_stale(name, PREFIX):
            remove(os.path.join(temporary, name))


def remove(directory: str) -> None:
    """Remove ``directory`` and everything in it; never raises, warns naming what is left
    where something cannot be removed."""
    try:
        remove_tree(directory)
    except FileNotFoundError:
        pass
    except OSError as error:
        warnings.warn(f"sandbox: could not remove the working directory {directory}: {error}", SandboxWarning,
                      stacklevel=2)


def remove_tree(directory: str) -> None:
    """Remove a directory tree however deep and whatever permissions it holds: no
    recursion (an explicit stack), every call relative to an open directory (no path
    longer than one name), each directory made ``0o700`` before it is read, links
    removed and never followed. Moving up uses ``..`` of the directory just emptied,
    which is safe because nothing of the program runs any more."""
    _make_enterable(directory, None)
    descriptor = os.open(directory, DIRECTORY_FLAGS)
    stack = [(None, _subdirectories_after_removing_the_rest(descriptor))]  # (name in parent, left to enter)
    try:
        while stack:
            name, left = stack[-1]
            if left:
                child = left.pop()
                _make_enterable(child, descriptor)
                inner = os.open(child, DIRECTORY_FLAGS, dir_fd=descriptor)
                os.close(descriptor)
                descriptor = inner
                stack.append((child, _subdirectories_after_removing_the_rest(descriptor)))
                continue
            stack.pop()
            if stack:
                outer = os.open("..", DIRECTORY_FLAGS, dir_fd=descriptor)
                os.close(descriptor)
                descriptor = outer
                os.rmdir(name, dir_fd=descriptor)
    finally:
        os.close(descriptor)
    os.rmdir(directory)


def _subdirectories_after_removing_the_rest(descriptor: int) -> list[str]:
    subdirectories = []
    with os.scandir(descriptor) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                subdirectories.append(entry.name)
            else:
                os.unlink(entry.name, dir_fd=descriptor)
    return subdirectories


def _make_enterable(name: str, parent: int | None) -> None:
    """Give a directory (never a link: checked first) back to its owner for listing and
    removing entries, whatever mode the program set."""
    if stat.S_ISDIR(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode):
        os.chmod(name, 0o700, dir_fd=parent)
