"""The GRPO module's settings, as dataclasses that YAML configs fill in (the rollout's,
``RolloutConfig``, is ``rollout/config.py``'s; the rewards', ``RewardConfig``,
``rewards/config.py``'s)."""

from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Literal

import torch

from lightning_logra.core.config import DEFAULT_TARGET_MODULES
from lightning_logra.core.validation import FieldChecks
from lightning_logra.rl.importance import IMPORTANCE_SAMPLING_MODES
from lightning_logra.rl.kl_estimators import KL_ESTIMATORS
from lightning_logra.rl.logprobs import DEFAULT_CHUNK_SIZE
# Moved to rollout/config.py; still importable here, where checkpoints written before the move name it.
from lightning_logra.rollout.config import RolloutConfig  # noqa: F401


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
    kl_estimator: Literal["k1", "k2", "k3", "low_var"] = "k3"
    """The KL penalty's per-token estimate (``rl.kl_estimators``): k1 ``log p - log ref``, k2 its square / 2, k3
    ``exp(-x) + x - 1`` (unbiased, never negative), low_var k3 clamped at 10 (verl's ``low_var_kl``)."""
    entropy_coef: float = 0.0
    """Weight of an entropy bonus: the mean entropy of the trained tokens' distributions is subtracted from the loss
    (whatever the loss type's normaliser, as TRL does); 0: off."""
    tis: bool | None = None
    """Importance sampling of the rollout-engine/trainer ratio in the clipped losses; None: on exactly with vLLM rollouts."""
    importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = \
        "token_truncate"
    """How the ratio weighs the loss (TRL's ``vllm_importance_sampling_mode``, ``rl.importance``): per token or per
    sequence, truncated into [``tis_min``, ``tis_cap``] or masked outside it. ``token_truncate``: the paper's (TRL's
    default is ``sequence_mask`` with a cap of 3)."""
    tis_cap: float = 2.0
    """Upper bound of the rollout-engine/trainer importance ratio."""
    tis_min: float | None = None
    """Lower bound of the ratio (0 <= ``tis_min`` < ``tis_cap``); None: none."""
    off_policy_mask_threshold: float | None = None
    """DeepSeek-V3.2's off-policy sequence mask: a sequence with a negative advantage whose mean per-token
    ``log p_rollout - log p_trainer`` is above this leaves the loss; None: off."""
    response_length_reference: float | None = None
    """The authors' newer length-normalised advantage: each sequence's advantage times this / its trained tokens;
    None: off."""
    baseline_weight: float = 0.1
    """``reinforce_baseline``: weight of each step's mean reward in the running baseline, in (0, 1]."""
    failure_reward: float = -0.01
    """``reinforce_baseline``: every reward <= 0 becomes this before the baseline."""
    success_threshold: float | None = None
    """``reinforce_baseline``: with a value (the authors' newer code: 1.0, for fractional rewards), a reward at or
    above it becomes 1 and every other one ``failure_reward``; None: only rewards <= 0 are failures."""
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
        check.choice("kl_estimator", KL_ESTIMATORS)
        check.number("entropy_coef", at_least=0)
        check.boolean("tis", optional=True)
        check.choice("importance_sampling_mode", IMPORTANCE_SAMPLING_MODES)
        check.number("tis_cap", above=0)
        check.number("tis_min", at_least=0, optional=True)
        check.require("tis_min", self.tis_min is None or self.tis_min < self.tis_cap, f"below tis_cap ({self.tis_cap})")
        check.require("importance_sampling_mode", not (self.type == "gspo" and self.importance_sampling_mode == "token_mask"),
                      "token_truncate, sequence_truncate or sequence_mask for gspo, which weighs whole sequences")
        check.number("off_policy_mask_threshold", above=0, optional=True)
        check.number("response_length_reference", above=0, optional=True)
        check.number("baseline_weight", above=0, at_most=1)
        check.number("failure_reward")
        check.number("success_threshold", optional=True)
        check.boolean("mask_truncated")
        check.integer("overlong_buffer", at_least=0)
        check.number("overlong_penalty", at_least=0)


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


@dataclass
class BatchingConfig:
    """How each rollout batch trains: ``num_iterations`` passes of ``mini_batches`` optimizer
    steps (whole prompt groups per mini-batch; ``max_steps`` counts optimizer steps), each
    step's rollouts going through forward/backward ``micro_batch_size`` at a time (or packed
    by ``micro_batch_tokens``), their log-probs computed in chunks of
    ``logprob_chunk_positions`` positions, so full-vocabulary logits of a whole micro-batch
    never exist."""

    micro_batch_size: int = 4
    """Rollouts per forward/backward, left-padded to the longest (the default way to
    micro-batch); also the rows per no-grad forward of the old and reference log-probs."""
    micro_batch_tokens: int | None = None
    """Instead of ``micro_batch_size``, group rollouts into micro-batches of at most this
    many real tokens (prompt + completion; first-fit decreasing) and run each as one packed
    row whose position ids restart per sequence: no padding token is computed in the
    policy's forward/backward, the old and reference log-probs, or LoGRA's KL probe.
    Log-probs, losses and gradients equal the padded computation's (to float rounding). A
    sequence longer than the budget runs alone (one warning names the budget). Needs a model
    whose attention follows packed ``position_ids`` with no attention mask: when the fit
    starts, packed and padded log-probs of a small random batch are compared and a model
    whose differ (e.g. OPT, BLOOM) is refused, naming its class. None: ``micro_batch_size``."""
    num_iterations: int = 1
    """Passes over each rollout batch (TRL's and verl's ``num_iterations``, ``ppo_epochs``)."""
    mini_batches: int = 1
    """Optimizer steps per pass; a mini-batch is whole prompt groups, so it must divide the
    prompts per rank (the data module's ``batch_size``)."""
    logprob_chunk_positions: int = DEFAULT_CHUNK_SIZE
    """Log-probs are computed in chunks of this many positions: one chunk's full-vocabulary
    logits exist at a time, in forward and in backward."""

    def __post_init__(self) -> None:
        check = FieldChecks.of(self)
        check.integer("micro_batch_size", at_least=1)
        check.integer("micro_batch_tokens", at_least=1, optional=True)
        check.integer("num_iterations", at_least=1)
        check.integer("mini_batches", at_least=1)
        check.integer("logprob_chunk_positions", at_least=1)


@dataclass
class LoggingConfig:
    """What ``GRPOModule`` logs beyond its metrics: tables of sampled completions, and how far
    each optimizer step moved the policy."""

    completions_every: int = 0
    """Every this many training steps, a table ``step, prompt, completion, answer, reward,
    reward/<function>..., length, truncated`` of ``completions_count`` samples goes to the
    loggers (an MLflow table artifact ``completions/step_<step>.json``); 0: never."""
    completions_count: int = 8
    """Samples in each ``completions_every`` table."""
    val_completions: bool = False
    """Log every validation sample (prompt, completion, answer, rewards) as a table, all of
    them, gathered from every rank (``val_completions/step_<step>.json`` in MLflow):
    per-prompt results to compare runs on."""
    step_kl: bool = True
    """Measure how far every optimizer step moved the policy, for any method (dense, LoRA,
    LoGRA): ``policy/step_kl``, KL(before || after) averaged over the update's trained
    positions (what LoGRA's budget bounds), estimated on ``step_kl_rows`` rows by k3 at
    tokens freshly drawn from the pre-step policy in the training forward (``rl.step_kl``),
    scored again by one no-grad forward over those rows after the step."""
    step_kl_rows: int = 4
    """Rows per update (per rank) ``policy/step_kl`` is measured on, drawn in strata of equal
    expected KL by advantage (as ``kl_probe: weighted``); 0: every row (exact up to the token draws, a forward over the whole batch)."""

    kl_from_init: bool = False
    """At every validation, ``val/kl_from_init``: KL(policy || initial policy) at the sampling
    temperature, averaged over the validation completions' positions, estimated by k3 at 4
    tokens per position drawn from the policy (``rl.step_kl``). Loads the initial weights
    once more, frozen, as ``loss.kl_coef > 0`` does (shared with it when both are set)."""

    def __post_init__(self) -> None:
        check = FieldChecks.of(self)
        check.integer("completions_every", at_least=0)
        check.integer("completions_count", at_least=1)
        check.boolean("val_completions")
        check.boolean("step_kl")
        check.integer("step_kl_rows", at_least=0)
        check.boolean("kl_from_init")


# Plain dataclasses, safe to rebuild: checkpoints that hold them as hyper-parameters load
# under torch.load's default weights_only=True, as Lightning passes it.
torch.serialization.add_safe_globals([LossConfig, OptimizerConfig, LoRAConfig, BatchingConfig, LoggingConfig])


def lr_factor(step: int, config: OptimizerConfig) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine to ``min_lr_ratio`` at ``decay_steps``."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.decay_steps <= config.warmup_steps:
        return 1.0
    progress = min((step - config.warmup_steps) / (config.decay_steps - config.warmup_steps), 1.0)
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
