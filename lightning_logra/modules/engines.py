"""Keeping the rollout engine in step with training: the module keeps the low-rank form of
each LoGRA update its optimizer steps returned and syncs the engine once per training step,
in full or by those updates. Here, not in ``rollout/``, because the module layer owns its
engine."""

from __future__ import annotations

from torch import nn

from lightning_logra.core.report import StepReport
from lightning_logra.rollout.base import RolloutEngine
from lightning_logra.rollout.config import RolloutConfig


def step_low_rank_updates(report: StepReport | None, strategy: object) -> list:
    """The low-rank form of the LoGRA update that just ran (``[]`` when it was skipped), from
    the ``StepReport`` its optimizer step returned, for the next weight sync. No report: the
    step was no LoGRA update (``strategy`` is named in the error)."""
    if report is None:
        raise ValueError("rollout.weight_sync='lowrank' needs every optimizer step to be a LoGRA update "
                         f"(strategy logra_fsdp); this run's strategy is {type(strategy).__name__}")
    return list(report.low_rank_updates or [])


def sync_engine(engine: RolloutEngine, policy: nn.Module, config: RolloutConfig, updates: int,
                received: list[list]) -> None:
    """Bring the rollout engine to the trained weights: in full, or with ``weight_sync:
    lowrank`` by the ``received`` LoGRA updates of this step's ``updates`` optimizer steps
    (every one must have reached us)."""
    if config.weight_sync != "lowrank":
        engine.sync_weights(policy)
        return
    if len(received) != updates:
        raise ValueError(f"rollout.weight_sync='lowrank' needs every optimizer step to be a LoGRA update "
                         f"(strategy logra_fsdp); {updates} steps ran, {len(received)} reported one")
    engine.sync_weights(policy, low_rank_updates=[u for step in received for u in step])
