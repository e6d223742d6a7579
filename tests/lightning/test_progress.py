"""StepProgressBar: steps out of max_steps and seconds per step when max_steps is set."""

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_logra.callbacks import StepProgressBar


class LinearModule(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch).pow(2).mean()
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(tmp_path, **trainer_args) -> L.Trainer:
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_model_summary=False, default_root_dir=tmp_path,
                        callbacks=[StepProgressBar()], **trainer_args)
    trainer.fit(LinearModule(), DataLoader(torch.randn(10, 4)))  # 10 batches of 1
    return trainer


def test_counts_steps_out_of_max_steps_in_seconds_per_step(tmp_path, capsys):
    trainer = fit(tmp_path, max_steps=3)
    assert isinstance(trainer.progress_bar_callback, StepProgressBar)
    bar = trainer.progress_bar_callback.train_progress_bar
    assert bar.total == 3 and bar.n == 3
    assert bar.desc == "Train"
    assert "loss" in bar.postfix
    shown = str(bar)
    assert shown.startswith("Train 3/3 100%")
    assert "s/step" in shown and "it/s" not in shown
    frames = capsys.readouterr().out.replace("\n", "\r").split("\r")
    assert any(frame.startswith("Train 1/3 ") for frame in frames)
    assert any(frame.startswith("Train 2/3 ") for frame in frames)
    assert not any("Epoch" in frame for frame in frames)


def test_counts_on_across_epochs(tmp_path):
    trainer = fit(tmp_path, max_steps=13)  # 10 batches an epoch: one bar spans both epochs
    bar = trainer.progress_bar_callback.train_progress_bar
    assert (bar.total, bar.n) == (13, 13)
    assert str(bar).startswith("Train 13/13 100%")


def test_without_max_steps_it_is_lightnings_bar(tmp_path):
    trainer = fit(tmp_path, max_epochs=1)
    bar = trainer.progress_bar_callback.train_progress_bar
    assert (bar.total, bar.n) == (10, 10)
    assert bar.desc.startswith("Epoch 0")
    assert "it/s" in str(bar)
