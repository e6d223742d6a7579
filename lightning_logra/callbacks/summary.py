"""RunSummary: one table at the end of fit, so a long run ends with its answer."""

from __future__ import annotations

import time

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lightning_logra.callbacks.preemption import EXIT_STATUS, Preempted
from lightning_logra.core.memory import peak_memory_mib

GIB = 2**30


class RunSummary(Callback):
    """Prints reward before/after (mean of the first and last ``window`` steps this launch ran;
    a resumed run counts from its checkpoint's step), the last
    validation scores, peak memory, and LoGRA's state beside its dense-AdamW equivalent,
    at the end of fit, and when a SIGTERM stops the run (with the checkpoint that
    ``PreemptionCheckpoint`` saved, if any)."""

    def __init__(self, window: int = 3) -> None:
        self.window = window
        self.rewards: list[float] = []
        self._started = 0.0
        self._first_step = 0
        self._recorded_step: int | None = None

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        self._started = time.perf_counter()
        self._first_step = trainer.global_step  # above 0 when resumed from a checkpoint

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._record_reward(trainer)

    def _record_reward(self, trainer) -> None:
        """Once per step: a stop may come before this callback's turn in the last step."""
        reward = trainer.callback_metrics.get("reward/mean")
        if reward is not None and trainer.global_step != self._recorded_step:
            self.rewards.append(float(reward))
            self._recorded_step = trainer.global_step

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        rank_zero_info(self.render(trainer))

    @override
    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException):
            return  # an error: its traceback is the answer
        if trainer.training:
            self._record_reward(trainer)
        if isinstance(exception, Preempted):
            stop = (f"  stopped by {exception.signal_name} after step {exception.step}: "
                    f"checkpoint {exception.checkpoint} "
                    f"(resume with --ckpt_path=hpc, or trainer.fit(..., ckpt_path=\"hpc\"); exit status {EXIT_STATUS})")
        else:
            stop = (f"  stopped by SIGTERM at step {trainer.global_step}, without a checkpoint "
                    "(lightning_logra.callbacks.PreemptionCheckpoint saves one)")
        rank_zero_info(self.render(trainer) + "\n" + stop)

    def render(self, trainer) -> str:
        metrics = trainer.callback_metrics
        steps = trainer.global_step - self._first_step
        resumed = f" (resumed at step {self._first_step}, now at {trainer.global_step})" if self._first_step else ""
        lines = [f"Run summary: {steps} steps in {time.perf_counter() - self._started:.0f} s{resumed}"]
        if self.rewards:
            window = min(self.window, len(self.rewards))
            first = sum(self.rewards[:window]) / window
            last = sum(self.rewards[-window:]) / window
            lines.append(f"  reward/mean      first {window} steps {first:.3f} -> last {window} steps {last:.3f} ({last - first:+.3f})")
        for key in sorted(k for k in metrics if k.startswith("val/")):
            lines.append(f"  {key:<16} {float(metrics[key]):.3f} (last validation)")
        peak = peak_memory_mib()
        if "peak_allocated_mib" in peak:
            lines.append(f"  peak GPU memory  {peak['peak_allocated_mib'] / 1024:.2f} GiB allocated")
        else:
            lines.append(f"  peak memory      {peak['peak_rss_mib'] / 1024:.2f} GiB process RSS")
        if "memory/logra_state_mib" in metrics:
            state = float(metrics["memory/logra_state_mib"])
            dense = float(metrics["memory/dense_equivalent_mib"])
            lines.append(f"  LoGRA state      {state:,.1f} MiB vs {dense:,.1f} MiB for dense AdamW ({state / dense:.1%})")
        return "\n".join(lines)
