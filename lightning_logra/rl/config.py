"""The GRPO module's settings, as dataclasses that YAML configs fill in."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from lightning_logra.core.config import DEFAULT_TARGET_MODULES


@dataclass
class LossConfig:
    """``grpo``: group-normalised advantages, PPO-clipped token ratio. ``dr_grpo``: no std
    normalisation, constant length normaliser. ``gspo``: group-normalised advantages,
    PPO-clipped sequence-level ratio (set ``epsilon_low``/``epsilon_high`` to ~3e-4/4e-4).
    ``reinforce_baseline``: the paper's loss, running-mean baseline, failure reward,
    truncated importance sampling, no PPO ratio.

    ``tis``: truncated importance sampling of the rollout-engine/trainer ratio (capped at
    ``tis_cap``) in the clipped losses; ``None`` turns it on exactly when the rollout engine
    is vLLM. ``reinforce_baseline`` always uses it.
    Overlong handling (DAPO): ``mask_truncated`` leaves completions that hit
    ``rollout.max_new_tokens`` out of the loss; ``overlong_buffer > 0`` adds a penalty that
    grows linearly from 0 to ``-overlong_penalty`` over the last ``overlong_buffer`` tokens.
    """

    type: Literal["grpo", "dr_grpo", "gspo", "reinforce_baseline"] = "grpo"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    aggregation: Literal["token", "sequence"] = "token"
    kl_coef: float = 0.0  # > 0 builds a frozen reference model for a k3 KL penalty
    tis: bool | None = None
    tis_cap: float = 2.0
    baseline_weight: float = 0.1
    failure_reward: float = -0.01
    mask_truncated: bool = False
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0

    def __post_init__(self) -> None:
        for name in ("epsilon_low", "epsilon_high", "tis_cap", "baseline_weight"):
            if not getattr(self, name) > 0:
                raise ValueError(f"loss.{name} = {getattr(self, name)!r} must be > 0")
        for name in ("kl_coef", "overlong_buffer", "overlong_penalty"):
            if getattr(self, name) < 0:
                raise ValueError(f"loss.{name} = {getattr(self, name)!r} must be >= 0")


@dataclass
class RolloutConfig:
    """Sampling settings. Rollout log-probs are those of the temperature-scaled, untruncated
    distribution, the one the trainer scores, whatever ``top_p``/``top_k`` sample from.

    ``dynamic_sampling`` (DAPO): groups whose rewards are all equal carry no signal; they are
    dropped and replaced by groups of further prompts, drawn from the training set, over at
    most ``max_sampling_rounds`` extra generation rounds (then the batch is filled up with
    dropped groups, and counted)."""

    engine: Literal["hf", "vllm"] = "hf"
    num_generations: int = 8
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 3
    val_temperature: float = 0.7
    val_top_p: float = 0.7
    val_generations: int = 4  # n samples per validation prompt: pass@1 and pass@n
    gpu_memory_utilization: float = 0.3  # vLLM on GPU only
    kv_cache_gib: float = 1.0  # vLLM on CPU only: memory for its KV cache
    # vLLM only: "lowrank" sends each LoGRA update as (alpha D, seed of A) and a full copy
    # every full_sync_every syncs; "full" sends every weight every time
    weight_sync: Literal["full", "lowrank"] = "full"
    full_sync_every: int = 50

    def __post_init__(self) -> None:
        for name in ("num_generations", "max_new_tokens", "val_generations"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"rollout.{name} = {getattr(self, name)!r} must be an integer >= 1")
        if self.weight_sync == "lowrank" and self.engine != "vllm":
            raise ValueError("rollout.weight_sync='lowrank' needs rollout.engine='vllm': the HF engine generates "
                             "with the training model itself and syncs nothing")
        if not (isinstance(self.full_sync_every, int) and self.full_sync_every >= 1):
            raise ValueError(f"rollout.full_sync_every = {self.full_sync_every!r} must be an integer >= 1")
        if not self.kv_cache_gib > 0:
            raise ValueError(f"rollout.kv_cache_gib = {self.kv_cache_gib!r} must be > 0")
        if self.engine == "vllm" and (self.top_p < 1 or self.top_k):
            raise ValueError(
                f"rollout.top_p = {self.top_p!r} / rollout.top_k = {self.top_k!r} with rollout.engine='vllm': vLLM's "
                "log-probs are then those of the truncated distribution, the trainer's of the full one; use "
                "top_p: 1.0 and top_k: 0 for training rollouts (val_top_p applies to validation only)")
        for name in ("top_k", "max_sampling_rounds"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 0):
                raise ValueError(f"rollout.{name} = {getattr(self, name)!r} must be an integer >= 0")
        for name in ("temperature", "val_temperature"):
            if not getattr(self, name) > 0:
                raise ValueError(f"rollout.{name} = {getattr(self, name)!r} must be > 0")
        for name in ("top_p", "val_top_p", "gpu_memory_utilization"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"rollout.{name} = {getattr(self, name)!r} must be in (0, 1]")


@dataclass
class OptimizerConfig:
    """AdamW for dense and LoRA training (the paper's dense baseline by default). Under
    ``logra_fsdp`` none of it applies unless ``logra.follow_lr_schedule`` is set: LoGRA's
    step is ``logra.update_ratio``, and its schedule is the KL budget's."""

    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    warmup_steps: int = 9
    decay_steps: int = 300  # cosine to min_lr_ratio over this many steps; 0 keeps the lr constant
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"optimizer.lr = {self.lr!r} must be > 0")
        if self.warmup_steps < 0 or self.decay_steps < 0:
            raise ValueError("optimizer.warmup_steps and optimizer.decay_steps must be >= 0")


@dataclass
class LoRAConfig:
    """The LoRA baseline (peft), on the same projections LoGRA trains."""

    rank: int = 256
    alpha: float = 512.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGET_MODULES))
