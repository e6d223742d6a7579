"""A Lightning module that records the prompts of every training batch, and a fit of it on
``PromptDataModule`` arithmetic rows that checkpoints every ``every_n_steps`` steps."""

from __future__ import annotations

import warnings

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_logra.data import PromptDataModule, ResumableSampler


class PromptRecorder(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch["prompt_text"])
        return self.weight.square().sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit_prompts(folder, max_steps, ckpt_path=None, *, train_size=9, every_n_steps=3, devices=1) -> list[list[str]]:
    """The prompts of each batch this process trained on, in batches of 2 (on ``devices``
    CPU processes: the caller starts them)."""
    recorder = PromptRecorder()
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
        max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=folder, every_n_train_steps=every_n_steps, save_top_k=-1)],
    )
    data = PromptDataModule("arithmetic", batch_size=2, train_size=train_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's notes on few batches and workers
        trainer.fit(recorder, datamodule=data, ckpt_path=ckpt_path)
    return recorder.seen


def epoch_order(train_size: int, epoch: int, ranks: int, rank: int) -> list[str]:
    """The prompts ``rank`` of ``ranks`` trains on in ``epoch`` (seed 0), before batching."""
    data = PromptDataModule("arithmetic", batch_size=2, train_size=train_size)
    data.setup("fit")
    sampler = ResumableSampler(data.datasets["train"], num_replicas=ranks, rank=rank, seed=0)
    sampler.set_epoch(epoch)
    return [data.datasets["train"].prompt_texts[index] for index in sampler]
