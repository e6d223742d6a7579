"""Keeping the rollout engine in step with training: the module reads each LoGRA update's
low-rank form off the trainer's strategy (``hooks.last_step_report``) and syncs the engine
once per training step, in full or by those updates. Here, not in ``rollout/``, because it
needs Lightning's trainer."""

from __future__ import annotations

from torch import nn

from lightning_logra.hooks import last_step_report
from lightning_logra.rollout.base import RolloutEngine
from lightning_logra.rollout.config import RolloutConfig


def step_low_rank_updates(trainer) -> list:
    """The low-rank form of the LoGRA update that just ran (``[]`` when it was skipped), from
    its ``StepReport``, for the next weight sync."""
    report = last_step_report(trainer)
    if report is None:
        raise ValueError("rollout.weight_sync='lowrank' needs every optimizer step to be a LoGRA update "
                         f"(strategy logra_fsdp); this run's strategy is {type(trainer.strategy).__name__}")
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
