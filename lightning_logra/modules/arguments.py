"""GRPOModule's arguments: its config groups with their deprecated flat names set in, its own
scalar arguments checked the way every config dataclass checks its fields
(``core/validation.py``) before anything loads, and the micro-batching they make."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from lightning_logra.core.validation import FieldChecks, warn_renamed
from lightning_logra.rewards.config import RewardConfig
from lightning_logra.rl.batch import MicroBatching
from lightning_logra.rl.config import BatchingConfig, LoggingConfig, LoRAConfig, LossConfig
from lightning_logra.rollout.config import RolloutConfig

# Deprecated arguments -> today's names: each warns once, as a keyword argument or a YAML key
# (and reads, not writes, as an attribute); checkpoints' hparams hold the groups.
DEPRECATED_ALIASES: dict[str, str] = {
    "rewards": "reward.functions",
    "reward_weights": "reward.weights",
    "reward_timeout_s": "reward.timeout_s",
    "reward_max_consecutive_timeouts": "reward.max_consecutive_timeouts",
    "micro_batch_size": "batching.micro_batch_size",
    "micro_batch_tokens": "batching.micro_batch_tokens",
    "num_iterations": "batching.num_iterations",
    "mini_batches": "batching.mini_batches",
    "logprob_chunk_positions": "batching.logprob_chunk_positions",
    "logprob_chunk_size": "batching.logprob_chunk_positions",
    "log_completions_every": "logging.completions_every",
    "log_completions_count": "logging.completions_count",
    "log_val_completions": "logging.val_completions",
    "measure_step_kl": "logging.step_kl",
}
GROUPS = {"reward": RewardConfig, "batching": BatchingConfig, "logging": LoggingConfig}


def config_groups(reward: RewardConfig | None, batching: BatchingConfig | None, logging: LoggingConfig | None,
                  flat: Mapping[str, Any]) -> tuple[RewardConfig, BatchingConfig, LoggingConfig]:
    """The groups as given (None: the defaults) with the deprecated flat arguments ``flat``
    (name -> value, None: not given) set in, each given one warning once; the groups check
    the values. A flat argument whose field is also set to another value, in its group (not
    the default) or under another deprecated name, raises ``ValueError`` naming both."""
    given = {"reward": reward, "batching": batching, "logging": logging}
    groups = {name: GROUPS[name]() if config is None else config for name, config in given.items()}
    changes: dict[str, dict[str, Any]] = {name: {} for name in groups}
    set_by: dict[str, str] = {}  # "<group>.<field>" -> the deprecated name that set it
    for old, value in flat.items():
        if value is None:
            continue
        new = DEPRECATED_ALIASES[old]
        group, field = new.split(".")
        other = set_by.get(new, new)
        current = changes[group].get(field, getattr(groups[group], field))
        if current != value and (other != new or current != getattr(GROUPS[group](), field)):
            raise ValueError(f"GRPOModule.{old} = {value!r} and GRPOModule.{other} = {current!r} are both given: "
                             f"{old} is the deprecated name of {new}; give {new} only")
        warn_renamed("GRPOModule", old, new, stacklevel=3)  # at the module's caller
        changes[group][field] = value
        set_by[new] = old
    reward, batching, logging = (replace(groups[name], **changes[name]) if changes[name] else groups[name]
                                 for name in GROUPS)
    return reward, batching, logging


def check_arguments(loss: LossConfig, rollout: RolloutConfig, lora: LoRAConfig | None, values: dict[str, Any]) -> None:
    """``values``: the module's scalar arguments by name; the checks that join them with the
    loss and rollout configs name the config field."""
    buffer, generations, engine = loss.overlong_buffer, rollout.num_generations, rollout.engine
    check = FieldChecks("GRPOModule", {**values, "loss.overlong_buffer": buffer, "rollout.num_generations": generations,
                                       "rollout.engine": engine, "loss.tis": loss.tis})
    check.boolean("activation_checkpointing")
    check.integer("seed", at_least=0)
    check.require("loss.overlong_buffer", buffer <= rollout.max_new_tokens,
                  f"<= rollout.max_new_tokens = {rollout.max_new_tokens}")
    check.require("rollout.num_generations", loss.type == "reinforce_baseline" or generations >= 2,
                  f">= 2 with loss.type = {loss.type!r} (group advantages)")
    check.require("rollout.engine", lora is None or engine != "vllm", "'hf' with lora: vLLM would need merged weights")
    check.require("loss.tis", rollout.max_staleness == 0 or loss.tis is not False,
                  f"true or None with rollout.max_staleness = {rollout.max_staleness}: batches sampled by older "
                  "weights need the importance-sampling correction (training collapses without one)")
    weighted = loss.type == "reinforce_baseline" or _importance_sampling(loss, rollout)
    for name, default in (("importance_sampling_mode", "token_truncate"), ("tis_min", None)):
        if getattr(loss, name) != default and not weighted:
            # Without importance sampling the option would change nothing: say so rather than ignore it.
            raise ValueError(f"GRPOModule.loss.{name} = {getattr(loss, name)!r} has no effect: importance sampling is "
                             f"off (loss.tis = {loss.tis!r}, rollout.engine = {engine!r}); set loss.tis: true")


def micro_batching(loss: LossConfig, rollout: RolloutConfig, batching: BatchingConfig) -> MicroBatching:
    """How every forward of the module's policy and reference runs: micro-batches, log-probs at
    the sampling temperature, the loss; truncated importance sampling in the clipped losses as
    ``loss.tis`` says, else with vLLM or one-step-off rollouts only."""
    return MicroBatching(loss=loss, micro_batch_size=batching.micro_batch_size, temperature=rollout.temperature,
                         chunk_size=batching.logprob_chunk_positions, max_completion_length=rollout.max_new_tokens,
                         tis=_importance_sampling(loss, rollout),
                         micro_batch_tokens=batching.micro_batch_tokens)


def _importance_sampling(loss: LossConfig, rollout: RolloutConfig) -> bool:
    """``loss.tis``; None: on when another engine or older weights sample (vLLM, ``max_staleness > 0``)."""
    return loss.tis if loss.tis is not None else rollout.engine == "vllm" or rollout.max_staleness > 0
