"""Recovery at start-up for the Trainer: the folders a run writes checkpoints into and
reads them from, and what a crash left mid-save in each (``atomic.recover_folder``)
finished under that folder's writer lock."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_logra.strategies.checkpoints.atomic import recover_folder
from lightning_logra.strategies.checkpoints.writer_lock import recover_if_free


@runtime_checkable
class WritesCheckpointFolder(Protocol):
    """A callback other than a ModelCheckpoint that saves checkpoints into a folder (e.g.
    ``callbacks.PreemptionCheckpoint``): recovery holds and recovers that folder too."""

    def checkpoint_folder(self, trainer) -> Path:
        """Where this callback saves checkpoints in ``trainer``'s run."""
        ...


def recover_checkpoint_folders(trainer) -> None:
    """``atomic.recover_folder`` of every folder the Trainer reads checkpoints from, each
    under its writer lock; a folder another live run holds is left to that run."""
    for folder in checkpoint_folders(trainer):
        recover_if_free(folder, recover_folder)


def written_checkpoint_folders(trainer) -> list[Path]:
    """The folders the run writes checkpoints into: each ``WritesCheckpointFolder``
    callback's (e.g. ``default_root_dir``, where a PreemptionCheckpoint saves Lightning's
    HPC checkpoint), then every ModelCheckpoint's (as ``ckpt_path="last"`` resolves it,
    before its setup has run)."""
    folders = [Path(callback.checkpoint_folder(trainer))
               for callback in trainer.callbacks if isinstance(callback, WritesCheckpointFolder)]
    folders += [Path(callback._ModelCheckpoint__resolve_ckpt_dir(trainer))
                for callback in trainer.checkpoint_callbacks if isinstance(callback, ModelCheckpoint)]
    return list(dict.fromkeys(folders))


def checkpoint_folders(trainer) -> list[Path]:
    """Where the Trainer reads checkpoints: the folders it writes, and ``default_root_dir``
    (SLURM's and preemption's ``hpc_ckpt_*``)."""
    return list(dict.fromkeys([Path(trainer.default_root_dir), *written_checkpoint_folders(trainer)]))
