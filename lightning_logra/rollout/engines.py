"""The rollout engine a ``RolloutConfig`` names, built around a policy already on its
device (vLLM is imported only when asked for). Keeping it in sync with training is the
module's job (``modules/engines.py``)."""

from __future__ import annotations

from torch import nn

from lightning_logra.rollout.base import RolloutEngine
from lightning_logra.rollout.config import RolloutConfig


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
