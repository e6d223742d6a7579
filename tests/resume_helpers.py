"""A GRPO module that records what a resume test compares: every logged training metric
and, at the end, the full policy weights."""

from __future__ import annotations

import torch
from lightning.pytorch.callbacks import Callback

from lightning_logra.modules import GRPOModule


class RecordingGRPO(GRPOModule):
    def __init__(self, *args, record_to: str | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.record_to = record_to
        self.history: dict[int, dict[str, float]] = {}

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items() if not k.startswith(("perf/", "memory/"))}
        self.history[self.global_step] = metrics

    def on_train_end(self) -> None:
        weights = {}
        for name, value in self.policy.state_dict().items():
            weights[name] = (value.full_tensor() if hasattr(value, "full_tensor") else value).clone()
        if self.record_to and self.global_rank == 0:
            torch.save({"weights": weights, "history": self.history, "baseline": self.baseline.value}, self.record_to)
        self.final_weights = weights


class SlowDown(Callback):
    """Gives a kill -9 test time to strike mid-step."""

    def __init__(self, seconds: float = 0.5) -> None:
        self.seconds = seconds

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        import time

        time.sleep(self.seconds)
