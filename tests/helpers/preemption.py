"""A callback that signals its own process at a chosen point of a fit, as a spot instance,
Kubernetes or SLURM would, but deterministically."""

from __future__ import annotations

import os
import signal

from lightning.pytorch.callbacks import Callback


class SignalDuringStep(Callback):
    """Sends ``signal_name`` to this process at the start of the step that ends at ``step``
    (with ``in_validation``, at the start of the validation run after that step), on the
    ranks listed in ``ranks`` (all by default): it arrives during that step (validation)."""

    def __init__(self, step: int = 2, signal_name: str = "SIGTERM", ranks: list[int] | None = None,
                 in_validation: bool = False) -> None:
        self.step = step
        self.signum = signal.Signals[signal_name]
        self.ranks = ranks
        self.in_validation = in_validation

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.in_validation and trainer.global_step == self.step - 1:
            self._send(trainer)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if self.in_validation and not trainer.sanity_checking and trainer.global_step == self.step and batch_idx == 0:
            self._send(trainer)

    def _send(self, trainer) -> None:
        if self.ranks is None or trainer.global_rank in self.ranks:
            os.kill(os.getpid(), self.signum)
