"""A progress bar for step-budgeted RL runs.

Lightning's bars count batches within an epoch ("Epoch 0/-2", "0.00it/s" when only
``max_steps`` is set). An RL run is sized in optimizer steps of tens of seconds each, so
with ``max_steps`` set this bar counts steps out of ``max_steps`` and shows seconds per step:

    Train 3/12  25%|██▌       | [01:58<05:56, 39.52s/step, v_num=0, reward=0.156]
"""

from __future__ import annotations

import sys
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm
from lightning.pytorch.utilities.types import STEP_OUTPUT
from typing_extensions import override


class StepProgressBar(TQDMProgressBar):
    """:class:`~lightning.pytorch.callbacks.TQDMProgressBar` that, when ``trainer.max_steps > 0``,
    shows the training bar as optimizer steps out of ``max_steps`` (continuing from the restored
    step on resume, across epochs) and the time per step in seconds. Otherwise, and for the
    validation, test and predict bars, it behaves as its parent."""

    STEP_BAR_FORMAT = (
        "{desc} {n_fmt}/{total_fmt} {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}, {rate_inv_fmt}{postfix}]"
    )

    @override
    def init_train_tqdm(self) -> Tqdm:
        if not _counts_steps(self.trainer):
            return super().init_train_tqdm()
        return Tqdm(
            desc="Train",
            total=self.trainer.max_steps,
            initial=self.trainer.global_step,  # so the rate counts only this run's steps
            unit="step",
            position=(2 * self.process_position),
            disable=self.is_disabled,
            leave=True,
            dynamic_ncols=True,
            file=sys.stdout,
            smoothing=0,
            bar_format=self.STEP_BAR_FORMAT,
        )

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if not _counts_steps(trainer):
            super().on_train_epoch_start(trainer, *args)
        elif self._leave:  # one bar per epoch, as the parent, each counting on from the current step
            self.train_progress_bar = self.init_train_tqdm()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: STEP_OUTPUT, batch: Any, batch_idx: int
    ) -> None:
        if not _counts_steps(trainer):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        bar = self.train_progress_bar
        step = trainer.global_step
        if not bar.disable and self._should_update(step, bar.total):
            bar.n = step
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes the bar


def _counts_steps(trainer: pl.Trainer) -> bool:
    return trainer.max_steps is not None and trainer.max_steps > 0
