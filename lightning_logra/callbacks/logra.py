"""LoGRACallback: logs what every LoGRA step did. It owns no math and no state that the
optimizer needs: the strategy runs the step (KL control included), returns its
``StepReport`` to the module that stepped and keeps it in ``trainer.strategy.last_report``
for observers such as this callback, which logs it."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_logra.core.memory import memory_report, peak_memory_mib
from lightning_logra.hooks import ReportsLoGRASteps

MIB = 2**20
PROGRESS_BAR_KEYS = ("logra/predicted_kl", "logra/predicted_kl_scaled", "logra/alpha")


class LoGRACallback(Callback):
    """Logs ``logra/*`` (predicted KL before and after scaling, alpha, budget, mismatch,
    sketch norm, skipped steps, seconds in prepare / probe / apply) and ``memory/*`` every
    step. ``measure_kl=True`` asks the strategy to also measure the true KL of each applied
    update on the probe responses (one forward before and one after), logged as
    ``logra/measured_kl``. ``log_memory=False`` leaves out ``memory/*`` (LoGRA's state
    beside dense AdamW's, and the process's peak memory)."""

    def __init__(self, measure_kl: bool = False, log_memory: bool = True) -> None:
        self.measure_kl = measure_kl
        self.log_memory = log_memory
        self._state_mib: tuple[float, float] | None = None
        self._logged: Any = None

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int) -> None:
        strategy = trainer.strategy
        report = strategy.last_report if isinstance(strategy, ReportsLoGRASteps) else None  # None: a dense or LoRA run
        if report is None or report is self._logged:
            return
        self._logged = report
        metrics = report.metrics()
        if self.log_memory:
            metrics.update(self._memory_metrics(trainer))
        for key, value in metrics.items():
            pl_module.log(key, value, on_step=True, on_epoch=False, prog_bar=key in PROGRESS_BAR_KEYS, batch_size=1)

    def _memory_metrics(self, trainer) -> dict[str, float]:
        if self._state_mib is None:
            optimizer = trainer.strategy.logra_optimizer
            compute = next(iter(optimizer.sketches)).source.dtype
            report = memory_report(optimizer.model, optimizer.config, world_size=trainer.world_size, compute_dtype=compute,
                                   sketch_reduction=optimizer.layout.name, sketch_accumulation=optimizer.layout.accumulation)
            self._state_mib = (report.logra_state_bytes / MIB, report.dense_adamw_bytes / MIB)
        return {"memory/logra_state_mib": self._state_mib[0], "memory/dense_equivalent_mib": self._state_mib[1],
                **{f"memory/{key}": value for key, value in peak_memory_mib().items()}}
