"""Crash-consistent checkpoint folders: a complete checkpoint is never deleted before its
successor is complete and in place, and whatever a crash leaves is recovered at start-up.

A save of ``<dir>/<name>`` goes through hidden siblings named after a hash of ``name``, so
that no temporary name matches Lightning's ``hpc_ckpt_*`` or ``last*.ckpt`` patterns
(Lightning reads a version from any name containing ``hpc_ckpt_``):

1. every rank writes into ``.logra-partial-<hash>``;
2. rank 0 writes the marker ``logra-complete.json`` (``{"checkpoint": name}``) into it, by
   an atomic rename: from then on the folder is complete;
3. the current ``<name>``, if any, is renamed ``.logra-old-<hash>`` (a checkpoint of an
   earlier version without a marker gets one first);
4. ``.logra-partial-<hash>`` is renamed ``<name>``;
5. ``.logra-old-<hash>`` is deleted.

A checkpoint being removed is renamed ``.logra-removed-<hash>`` first, so a crash while
deleting never leaves a half-deleted folder under a checkpoint's name. Every step here
runs under the folder's writer lock (``writer_lock``): one run writes and recovers a folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

COMPLETE_MARKER = "logra-complete.json"
PARTIAL_PREFIX = ".logra-partial-"
OLD_PREFIX = ".logra-old-"
REMOVED_PREFIX = ".logra-removed-"
# What the previous protocol left: "<name>.partial" and "<name>.old", without a marker.
LEGACY_SUFFIXES = (".partial", ".old")


def partial_path(path: Path) -> Path:
    return path.with_name(PARTIAL_PREFIX + _name_hash(path.name))


def old_path(path: Path) -> Path:
    return path.with_name(OLD_PREFIX + _name_hash(path.name))


def is_complete(folder: Path) -> bool:
    return (folder / COMPLETE_MARKER).is_file()


def prepare(path: Path) -> Path:
    """Finish what a crash left for ``path``, clear an incomplete earlier attempt, and
    return the empty folder name to write into (rank 0, before any rank writes)."""
    recover(path)
    partial = partial_path(path)
    if partial.exists():
        shutil.rmtree(partial)
    return partial


def commit(partial: Path, path: Path) -> None:
    """Steps 2 to 5: mark ``partial`` complete, then put it in place of ``path`` (rank 0,
    once every rank has written its part)."""
    _write_marker(partial, path.name)
    _replace(partial, path)


def remove(path: Path) -> None:
    """Delete the checkpoint ``path`` (a folder or a file) without a moment where a partly
    deleted folder carries its name."""
    if path.is_dir() and not path.is_symlink():
        removed = path.with_name(REMOVED_PREFIX + _name_hash(path.name))
        path.rename(removed)
        _sync_folder(path.parent)
        shutil.rmtree(removed)
    elif path.exists() or path.is_symlink():
        path.unlink()


def recover(path: Path) -> None:
    """Bring ``path`` back to a complete checkpoint (or to nothing) from what an interrupted
    save left: a complete partial folder is moved into place, else a retired one restored;
    an incomplete partial folder and a stale retired one are deleted."""
    _refuse_legacy_leftovers(path)
    partial, old = partial_path(path), old_path(path)
    if partial.exists() and not is_complete(partial):
        shutil.rmtree(partial)
    if path.exists():
        if old.exists():
            shutil.rmtree(old)
        if partial.exists():
            _replace(partial, path)
        return
    if partial.exists():
        partial.rename(path)
        _sync_folder(path.parent)
    elif old.exists():
        old.rename(path)
        _sync_folder(path.parent)
    if old.exists():
        shutil.rmtree(old)


def recover_folder(folder: Path) -> list[Path]:
    """``recover`` every checkpoint of ``folder`` that a crash left in the middle of a save
    or a removal; return the checkpoints moved into place."""
    if not folder.is_dir():
        return []
    restored = []
    for leftover in sorted(folder.iterdir()):
        if leftover.name.startswith(REMOVED_PREFIX):
            shutil.rmtree(leftover)
        elif leftover.name.startswith((PARTIAL_PREFIX, OLD_PREFIX)) and leftover.exists():
            name = _marked_name(leftover)
            if name is None:  # a partial folder that was never marked complete: nothing to recover
                shutil.rmtree(leftover)
                continue
            target = folder / name
            existed = target.exists()
            recover(target)
            if not existed and target.exists():
                restored.append(target)
        elif leftover.name.endswith(LEGACY_SUFFIXES) and (leftover / "logra").is_dir():
            _refuse_legacy_leftovers(leftover.with_name(leftover.name.rsplit(".", 1)[0]))
    return restored


def _replace(partial: Path, path: Path) -> None:
    """Steps 3 to 5 for the complete folder ``partial``."""
    if path.is_dir() and not path.is_symlink():
        if not is_complete(path):  # written before markers existed: recovery must know it is complete
            _write_marker(path, path.name)
        old = old_path(path)
        path.rename(old)
        partial.rename(path)
        _sync_folder(path.parent)
        shutil.rmtree(old)
        return
    if path.exists() or path.is_symlink():
        path.unlink()
    partial.rename(path)
    _sync_folder(path.parent)


def _write_marker(folder: Path, name: str) -> None:
    """Written under a temporary name and renamed, so the marker exists only whole."""
    staging = folder / (COMPLETE_MARKER + ".tmp")
    with open(staging, "w") as marker:
        json.dump({"checkpoint": name}, marker)
        marker.flush()
        os.fsync(marker.fileno())
    staging.rename(folder / COMPLETE_MARKER)
    _sync_folder(folder)


def _marked_name(folder: Path) -> str | None:
    try:
        name = json.loads((folder / COMPLETE_MARKER).read_text())["checkpoint"]
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(name, str) or folder.name not in (PARTIAL_PREFIX + _name_hash(name), OLD_PREFIX + _name_hash(name)):
        raise ValueError(
            f"{folder} names checkpoint {name!r} in its {COMPLETE_MARKER}, but it is not that checkpoint's "
            "temporary folder (copied from elsewhere?); move it out of the checkpoint folder"
        )
    return name


def _refuse_legacy_leftovers(path: Path) -> None:
    """The previous protocol's "<name>.partial" could be incomplete (it had no marker):
    which copy to keep is the user's call."""
    leftovers = [path.with_name(path.name + suffix) for suffix in LEGACY_SUFFIXES]
    found = [str(leftover) for leftover in leftovers if leftover.exists()]
    if found:
        state = "is present" if path.exists() else "is missing"
        raise RuntimeError(
            f"an interrupted save of an earlier lightning_logra left {' and '.join(found)} ({path} {state}); "
            f"{leftovers[1].name} is complete, {leftovers[0].name} may not be: keep one as {path.name} "
            "and delete the others"
        )


def _name_hash(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:16]


def _sync_folder(folder: Path) -> None:
    """Make the folder's renames durable (a power cut, not only a killed process)."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
