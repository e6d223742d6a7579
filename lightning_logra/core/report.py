"""StepReport: what one LoGRA step did, for loggers, callbacks and plain loops."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_logra.core.lowrank import LowRankUpdate


@dataclass(frozen=True)
class StepReport:
    """What one ``LoGRAOptimizer.step`` did. KL fields are None when nothing was probed."""

    update: int  # updates applied before this step
    skipped: bool  # no weight, moment, counter or projection changed
    skip_reason: str | None
    skipped_steps: int  # skipped steps so far in this run
    alpha: float | None
    predicted_kl: float | None
    predicted_kl_scaled: float | None
    budget: float | None
    mismatch: float
    mismatch_nonfinite_pairs: int  # log-prob pairs left out of this step's mismatch observation
    measured_kl: float | None
    sketch_norm: float | None
    weight_norm: float | None
    update_norm: float | None  # before alpha: update_ratio * weight_norm
    update_ratio: float
    prepare_s: float
    probe_s: float
    apply_s: float
    # The applied update as (alpha D, seed of A) per target when the step was asked to
    # record it (a rollout engine's low-rank weight sync); None otherwise or when skipped.
    low_rank_updates: tuple[LowRankUpdate, ...] | None = None

    def metrics(self) -> dict[str, float]:
        """The report as flat float metrics: ``logra/*``, and the wall-clock seconds of each
        phase as ``perf/logra_*_s`` (fields that are None are left out)."""
        values = {
            "predicted_kl": self.predicted_kl,
            "predicted_kl_scaled": self.predicted_kl_scaled,
            "alpha": self.alpha,
            "budget": self.budget,
            "mismatch": self.mismatch,
            "mismatch_nonfinite_pairs": float(self.mismatch_nonfinite_pairs),
            "measured_kl": self.measured_kl,
            "sketch_norm": self.sketch_norm,
            "update_ratio": self.update_ratio,
            "skipped_steps": float(self.skipped_steps),
        }
        metrics = {f"logra/{key}": float(value) for key, value in values.items() if value is not None}
        timings = {"prepare": self.prepare_s, "probe": self.probe_s, "apply": self.apply_s}
        return {**metrics, **{f"perf/logra_{phase}_s": seconds for phase, seconds in timings.items()}}
