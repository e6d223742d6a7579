"""Lightning's model summary, counting LoGRA's targets as trainable."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import ModelSummary
from typing_extensions import override

from lightning_logra.hooks import ReportsLoGRASteps


class LoGRAModelSummary(ModelSummary):
    """``ModelSummary`` whose "Trainable params" include the weights LoGRA trains: they are
    frozen for autograd only because their gradients arrive as sketches. Under any other
    strategy it is Lightning's summary unchanged. The shipped configs list it; with a
    plain ``Trainer`` add it to ``callbacks``."""

    def __init__(self, max_depth: int = 1, **summarize_kwargs: Any) -> None:
        super().__init__(max_depth=max_depth, **summarize_kwargs)
        self._logra_parameters = 0

    @override
    def on_fit_start(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        optimizer = strategy.logra_optimizer if isinstance(strategy, ReportsLoGRASteps) else None
        self._logra_parameters = 0 if optimizer is None else sum(state.weight.numel() for state in optimizer.sketches)
        super().on_fit_start(trainer, pl_module)

    @override
    def summarize(self, summary_data, total_parameters: int, trainable_parameters: int, *args: Any, **kwargs: Any) -> None:
        super().summarize(summary_data, total_parameters, trainable_parameters + self._logra_parameters, *args, **kwargs)
