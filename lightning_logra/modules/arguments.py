"""GRPOModule's own arguments checked the way every config dataclass checks its fields
(``core/validation.py``): the field, its value and what it must be, before anything loads."""

from __future__ import annotations

from typing import Any

from lightning_logra.core.validation import FieldChecks
from lightning_logra.rl.config import LoRAConfig, LossConfig
from lightning_logra.rollout.config import RolloutConfig


def check_arguments(loss: LossConfig, rollout: RolloutConfig, lora: LoRAConfig | None, values: dict[str, Any]) -> None:
    """``values``: the module's scalar arguments by name; the checks that join them with the
    loss and rollout configs name the config field."""
    buffer, generations, engine = loss.overlong_buffer, rollout.num_generations, rollout.engine
    check = FieldChecks("GRPOModule", {**values, "loss.overlong_buffer": buffer, "rollout.num_generations": generations,
                                       "rollout.engine": engine})
    check.timeout("reward_timeout_s")
    check.integer("reward_max_consecutive_timeouts", at_least=1)
    check.integer("micro_batch_size", at_least=1)
    check.integer("micro_batch_tokens", at_least=1, optional=True)
    check.integer("num_iterations", at_least=1)
    check.integer("mini_batches", at_least=1)
    check.integer("log_completions_every", at_least=0)
    check.integer("log_completions_count", at_least=1)
    check.boolean("activation_checkpointing")
    check.boolean("measure_step_kl")
    check.boolean("log_val_completions")
    check.integer("logprob_chunk_positions", at_least=1)
    check.integer("seed", at_least=0)
    check.require("loss.overlong_buffer", buffer <= rollout.max_new_tokens,
                  f"<= rollout.max_new_tokens = {rollout.max_new_tokens}")
    check.require("rollout.num_generations", loss.type == "reinforce_baseline" or generations >= 2,
                  f">= 2 with loss.type = {loss.type!r} (group advantages)")
    check.require("rollout.engine", lora is None or engine != "vllm", "'hf' with lora: vLLM would need merged weights")
