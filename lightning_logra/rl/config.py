"""The GRPO module's settings, as dataclasses that YAML configs fill in."""

from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Literal

import torch

from lightning_logra.core.config import DEFAULT_TARGET_MODULES
from lightning_logra.core.validation import FieldChecks


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
    """The policy loss (see the class description)."""
    epsilon_low: float = 0.2
    """PPO clip below: the ratio is clipped at 1 - epsilon_low."""
    epsilon_high: float = 0.2
    """PPO clip above: the ratio is clipped at 1 + epsilon_high (DAPO's clip-higher: larger)."""
    aggregation: Literal["token", "sequence"] = "token"
    """Mean over all tokens of the batch, or over each sequence's tokens then sequences."""
    kl_coef: float = 0.0
    """Weight of a k3 KL penalty towards the initial policy; > 0 builds a frozen reference model."""
    tis: bool | None = None
    """Truncated importance sampling in the clipped losses; None: on exactly with vLLM rollouts."""
    tis_cap: float = 2.0
    """Cap of the rollout-engine/trainer importance ratio."""
    baseline_weight: float = 0.1
    """``reinforce_baseline``: weight of each step's mean reward in the running baseline, in (0, 1]."""
    failure_reward: float = -0.01
    """``reinforce_baseline``: every reward <= 0 becomes this before the baseline."""
    mask_truncated: bool = False
    """Leave completions that hit ``rollout.max_new_tokens`` out of the loss."""
    overlong_buffer: int = 0
    """Last tokens before ``rollout.max_new_tokens`` over which the overlong penalty grows; 0: off."""
    overlong_penalty: float = 1.0
    """Penalty at ``rollout.max_new_tokens`` when ``overlong_buffer > 0``."""

    def __post_init__(self) -> None:
        check = FieldChecks.of(self)
        check.choice("type", ("grpo", "dr_grpo", "gspo", "reinforce_baseline"))
        check.number("epsilon_low", above=0)
        check.number("epsilon_high", above=0)
        check.choice("aggregation", ("token", "sequence"))
        check.number("kl_coef", at_least=0)
        check.boolean("tis", optional=True)
        check.number("tis_cap", above=0)
        check.number("baseline_weight", above=0, at_most=1)
        check.number("failure_reward")
        check.boolean("mask_truncated")
        check.integer("overlong_buffer", at_least=0)
        check.number("overlong_penalty", at_least=0)


@dataclass
class RolloutConfig:
    """Sampling settings. Rollout log-probs are those of the temperature-scaled, untruncated
    distribution, the one the trainer scores, whatever ``top_p``/``top_k`` sample from.

    ``dynamic_sampling`` (DAPO): groups whose rewards are all equal carry no signal; they are
    dropped and replaced by groups of further prompts, drawn from the training set, over at
    most ``max_sampling_rounds`` extra generation rounds (then the batch is filled up with
    dropped groups, and counted)."""

    engine: Literal["hf", "vllm"] = "hf"
    """Who generates: ``hf`` (the training model itself) or ``vllm``."""
    num_generations: int = 8
    """Completions sampled per prompt (the group of group-normalised advantages)."""
    max_new_tokens: int = 256
    """Most tokens per completion."""
    temperature: float = 1.0
    """Sampling temperature of the training rollouts (and of the trainer's log-probs)."""
    top_p: float = 1.0
    """Nucleus sampling of the training rollouts, in (0, 1]; 1: off (must be 1 with vLLM)."""
    top_k: int = 0
    """Top-k sampling of the training rollouts; 0: off (must be 0 with vLLM)."""
    dynamic_sampling: bool = False
    """(DAPO) Replace groups whose rewards are all equal by groups of further prompts."""
    max_sampling_rounds: int = 3
    """Extra generation rounds dynamic sampling may run per step."""
    val_temperature: float = 0.7
    """Sampling temperature of validation."""
    val_top_p: float = 0.7
    """Nucleus sampling of validation, in (0, 1]."""
    val_generations: int = 4
    """Samples per validation prompt: pass@1 and pass@n."""
    gpu_memory_utilization: float = 0.3
    """vLLM on GPU only: the fraction of GPU memory vLLM may take, in (0, 1]."""
    kv_cache_gib: float = 1.0
    """vLLM on CPU only: memory for its KV cache, in GiB."""
    weight_sync: Literal["full", "lowrank"] = "full"
    """vLLM only: ``lowrank`` sends each LoGRA update as (alpha D, seed of A) and a full copy
    every ``full_sync_every`` syncs; ``full`` sends every weight every time."""
    full_sync_every: int = 50
    """``weight_sync: lowrank``: syncs between two full copies."""

    def __post_init__(self) -> None:
        check = FieldChecks.of(self)
        check.choice("engine", ("hf", "vllm"))
        check.integer("num_generations", at_least=1)
        check.integer("max_new_tokens", at_least=1)
        check.number("temperature", above=0)
        check.number("top_p", above=0, at_most=1)
        check.integer("top_k", at_least=0)
        check.boolean("dynamic_sampling")
        check.integer("max_sampling_rounds", at_least=0)
        check.number("val_temperature", above=0)
        check.number("val_top_p", above=0, at_most=1)
        check.integer("val_generations", at_least=1)
        check.number("gpu_memory_utilization", above=0, at_most=1)
        check.number("kv_cache_gib", above=0)
        check.choice("weight_sync", ("full", "lowrank"))
        check.integer("full_sync_every", at_least=1)
        check.require("weight_sync", self.weight_sync == "full" or self.engine == "vllm",
                      "'full' unless engine='vllm': the HF engine generates with the training model itself "
                      "and syncs nothing")
        # vLLM's log-probs would be those of the truncated distribution, the trainer's of the full one.
        truncation = ("with engine='vllm' (its log-probs would be those of the truncated distribution, the "
                      "trainer's of the full one; val_top_p applies to validation only)")
        check.require("top_p", self.engine != "vllm" or self.top_p == 1, f"1.0 {truncation}")
        check.require("top_k", self.engine != "vllm" or self.top_k == 0, f"0 {truncation}")


@dataclass
class MultiTurnConfig:
    """Multi-turn rollouts with ``GRPOModule(tools=..., environment_factory=...)``: the model
    calls tools over several assistant turns. ``rollout.max_new_tokens`` bounds each whole
    completion, generated and tool tokens together."""

    max_turns: int = 4
    """Most assistant turns per rollout (tool calls in the last one are not run)."""
    tool_timeout_s: float = 5.0
    """Seconds a tool call (and an environment's ``reset`` and ``get_reward``) may take, at most 86400 (24 h); past
    it the model is told the call failed, and a ``reset`` fails its rollout."""
    max_hung_tool_calls: int = 8
    """Tool calls still running past their timeout (threads cannot be stopped) before the run stops with an error."""
    chat_template: str | None = None
    """A Jinja chat template that renders ``tools``, assistant ``tool_calls`` and ``tool`` messages; None: the
    tokenizer's when it renders tools, else the built-in ChatML tool template."""

    def __post_init__(self) -> None:
        check = FieldChecks.of(self)
        check.integer("max_turns", at_least=1)
        check.timeout("tool_timeout_s")
        check.integer("max_hung_tool_calls", at_least=0)
        check.require("chat_template", self.chat_template is None or isinstance(self.chat_template, str),
                      "a Jinja template string or None")


@dataclass
class OptimizerConfig:
    """AdamW for dense and LoRA training (the paper's dense baseline by default). Under
    ``logra_fsdp`` none of it applies unless ``logra.follow_lr_schedule`` is set: LoGRA's
    step is ``logra.update_ratio``, and its schedule is the KL budget's."""

    lr: float = 1e-6
    """Peak learning rate of AdamW."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW's moment decays, each in [0, 1)."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay."""
    warmup_steps: int = 9
    """Optimizer steps of linear warm-up from 0."""
    decay_steps: int = 300
    """Cosine decay to ``min_lr_ratio`` over this many steps; 0 keeps the lr constant."""
    min_lr_ratio: float = 0.1
    """The lr at the end of the decay, as a fraction of ``lr``, in [0, 1]."""

    def __post_init__(self) -> None:
        check = FieldChecks.of(self)
        check.number("lr", above=0)
        check.number_list("betas", 2, at_least=0, below=1)
        check.number("weight_decay", at_least=0)
        check.integer("warmup_steps", at_least=0)
        check.integer("decay_steps", at_least=0)
        check.number("min_lr_ratio", at_least=0, at_most=1)


@dataclass
class LoRAConfig:
    """The LoRA baseline (peft), on the same projections LoGRA trains."""

    rank: int = 256
    """Rank of the adapters."""
    alpha: float = 512.0
    """LoRA's scaling numerator: the adapters' product is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapters' input, in [0, 1)."""
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGET_MODULES))
    """Names of the linear layers that get adapters (peft's ``target_modules``)."""

    def __post_init__(self) -> None:
        check = FieldChecks.of(self)
        check.integer("rank", at_least=1)
        check.number("alpha", above=0)
        check.number("dropout", at_least=0, below=1)
        check.names("target_modules")


# Plain dataclasses, safe to rebuild: checkpoints that hold them as hyper-parameters load
# under torch.load's default weights_only=True, as Lightning passes it.
torch.serialization.add_safe_globals([LossConfig, RolloutConfig, OptimizerConfig, LoRAConfig])


def lr_factor(step: int, config: OptimizerConfig) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine to ``min_lr_ratio`` at ``decay_steps``."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.decay_steps <= config.warmup_steps:
        return 1.0
    progress = min((step - config.warmup_steps) / (config.decay_steps - config.warmup_steps), 1.0)
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
