"""What both strategy classes add to their Lightning base for checkpoints: folders written
atomically (``atomic``) under the folder's writer lock (``writer_lock``), holding DCP shards,
Lightning's metadata (``folder``) and LoGRA's state (the runtime's, ``logra_state``), and
each file operation run on rank 0 with its error raised on every rank."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_logra.strategies.checkpoints import atomic, writer_lock
from lightning_logra.strategies.checkpoints.folder import load_folder, require_folder, save_folder


class CheckpointFoldersMixin:
    """Atomic checkpoint folders that hold LoGRA's state (``self.runtime``'s), one writer
    per folder; the writer locks rank 0 holds are released at teardown."""

    def _init_checkpoints(self, checkpoint_lock_lease_s: float) -> None:
        self.checkpoint_lock_lease_s = writer_lock.check_lease(checkpoint_lock_lease_s, type(self).__name__)
        self._held_folders: set[Path] = set()  # rank 0's writer locks, released at teardown

    def _save_folder(self, path: Any, tensors: dict[str, Any], metadata: dict[str, Any]) -> None:
        """The checkpoint folder at ``path``: shards of ``tensors`` (state dicts),
        ``metadata`` and LoGRA's state, written atomically."""

        def write(folder: Path) -> None:
            save_folder(folder, tensors, metadata, rank=self.global_rank)
            self.runtime.save_state(folder, rank=self.global_rank)

        self._write_atomically(path, write)

    def _load_folder(self, path: Any, state: dict[str, Any], *, strict: bool, weights_only: bool | None) -> dict[str, Any]:
        """Restore ``state`` and LoGRA from the folder at ``path`` (first finishing what a
        crash left of its save, unless another live run holds that folder: then nothing is
        left to finish); return the metadata that ``state`` did not ask for."""
        path = Path(self.broadcast(path))
        self._on_rank_zero(writer_lock.recover_if_free, path.parent, lambda _: atomic.recover(path))
        owner = type(self).__name__
        require_folder(path, owner)
        logra_state = self.runtime.read_state(path)  # a structural mismatch fails before any state is loaded
        remaining = load_folder(path, state, strict=strict, weights_only=weights_only, owner=owner)
        self.runtime.load_state(logra_state)
        return remaining

    def _hold_folder(self, folder: Path) -> writer_lock.WriterLock:
        """Rank 0: the writer lock of ``folder`` (``writer_lock.hold``), kept until teardown."""
        lock = writer_lock.hold(folder, self.checkpoint_lock_lease_s)
        self._held_folders.add(Path(folder))
        return lock

    def remove_checkpoint(self, filepath: Any) -> None:
        """ModelCheckpoint deletes superseded checkpoints through this: renamed away first,
        so a crash never leaves a half-deleted folder under a checkpoint's name."""
        self._on_rank_zero(atomic.remove, Path(filepath))

    def teardown(self) -> None:
        self._release_writer_locks()
        super().teardown()

    def _release_writer_locks(self) -> None:
        for folder in self._held_folders:
            writer_lock.release(folder)
        self._held_folders.clear()

    def _write_atomically(self, path: Any, write: Callable[[Path], None]) -> None:
        """``write`` fills a hidden partial folder, put in place once every rank has
        finished and rank 0 has marked it complete (the steps of ``atomic``)."""
        path = Path(self.broadcast(path))
        self._on_rank_zero(self._prepare_save, path)
        partial = atomic.partial_path(path)
        write(partial)
        self.barrier()
        self._on_rank_zero(atomic.commit, partial, path)

    def _prepare_save(self, path: Path) -> None:
        """One writer per folder: the lock (held since start-up for the folders the run
        was set up to write, else taken now) still ours; then the leftovers of an
        interrupted save of ``path`` dealt with."""
        self._hold_folder(path.parent).renew()  # raises if another run took the lock over meanwhile
        atomic.prepare(path)

    def _on_rank_zero(self, operation: Callable[..., Any], *args: Any) -> None:
        """Run a file operation on rank 0 and raise its error on every rank (no rank is
        left waiting at a barrier); the other ranks go on once it is done."""
        error = None
        if self.global_rank == 0:
            try:
                operation(*args)
            except (OSError, RuntimeError, ValueError) as raised:
                error = raised
        error = self.broadcast(error)
        if error is not None:
            raise error
