"""The rollout engine a ``RolloutConfig`` names, built around a policy that the strategy
has already placed (vLLM is imported only when asked for)."""

from __future__ import annotations

from torch import nn

from lightning_logra.hooks import last_step_report
from lightning_logra.rl.config import RolloutConfig
from lightning_logra.rollout.base import RolloutEngine


def build_engine(config: RolloutConfig, policy: nn.Module, tokenizer, *, seed: int) -> RolloutEngine:
    """``config.engine``: ``"hf"`` generates with ``policy`` itself; ``"vllm"`` loads the
    model from the policy's folder and receives the policy's current weights at once."""
    if config.engine == "vllm":
        from lightning_logra.rollout.vllm import VLLMRolloutEngine

        engine = VLLMRolloutEngine(
            getattr(policy, "name_or_path", None) or policy.config._name_or_path,
            max_new_tokens=config.max_new_tokens, temperature=config.temperature, top_p=config.top_p,
            gpu_memory_utilization=config.gpu_memory_utilization, kv_cache_gib=config.kv_cache_gib, seed=seed,
            weight_sync=config.weight_sync, full_sync_every=config.full_sync_every,
        )
        engine.sync_weights(policy)
        return engine
    from lightning_logra.rollout.hf import HFRolloutEngine

    return HFRolloutEngine(policy, tokenizer, max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                           top_p=config.top_p, top_k=config.top_k)


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
