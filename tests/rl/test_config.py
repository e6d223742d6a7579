"""The GRPO module's settings refuse what they cannot mean, naming the class, field and range
(issue 23 item 9: finite, in range, right type; a bool is not a number)."""

import dataclasses
import re

import pytest

from lightning_logra.core.config import DEFAULT_TARGET_MODULES
from lightning_logra.rl.config import (BatchingConfig, LoggingConfig, LoRAConfig, LossConfig, MultiTurnConfig,
                                       OptimizerConfig)
from lightning_logra.rollout.config import RolloutConfig

NAN, INF = float("nan"), float("inf")


def refuses(config_class, allowed: str, **values):
    (field, value), = values.items()
    pattern = rf"{config_class.__name__}\.{field} = {re.escape(repr(value))} is invalid: must be {re.escape(allowed)}"
    with pytest.raises(ValueError, match=pattern):
        config_class(**values)


def test_defaults_are_unchanged():
    assert dataclasses.asdict(LossConfig()) == dict(
        type="grpo", epsilon_low=0.2, epsilon_high=0.2, aggregation="token", kl_coef=0.0, kl_estimator="k3",
        entropy_coef=0.0, tis=None, importance_sampling_mode="token_truncate", tis_cap=2.0, tis_min=None,
        off_policy_mask_threshold=None, response_length_reference=None, baseline_weight=0.1, failure_reward=-0.01,
        success_threshold=None, mask_truncated=False, overlong_buffer=0, overlong_penalty=1.0)
    assert dataclasses.asdict(RolloutConfig()) == dict(
        engine="hf", num_generations=8, max_new_tokens=256, temperature=1.0, top_p=1.0, top_k=0,
        dynamic_sampling=False, max_sampling_rounds=3, val_temperature=0.7, val_top_p=0.7, val_generations=4,
        gpu_memory_utilization=0.3, kv_cache_gib=1.0, weight_sync="full", full_sync_every=50,
        max_staleness=0, worker_threads=None)
    assert dataclasses.asdict(OptimizerConfig()) == dict(
        lr=1e-6, betas=(0.9, 0.95), weight_decay=0.0, warmup_steps=9, decay_steps=300, min_lr_ratio=0.1)
    assert dataclasses.asdict(LoRAConfig()) == dict(
        rank=256, alpha=512.0, dropout=0.0, target_modules=list(DEFAULT_TARGET_MODULES))
    assert dataclasses.asdict(BatchingConfig()) == dict(
        micro_batch_size=4, micro_batch_tokens=None, num_iterations=1, mini_batches=1, logprob_chunk_positions=256)
    assert dataclasses.asdict(LoggingConfig()) == dict(
        completions_every=0, completions_count=8, val_completions=False, step_kl=True, step_kl_rows=4, kl_from_init=False)


def test_a_nan_failure_reward_is_refused():
    refuses(LossConfig, "a finite number", failure_reward=NAN)


def test_a_nan_kl_coef_is_refused():
    refuses(LossConfig, "a finite number >= 0", kl_coef=NAN)


def test_an_infinite_overlong_penalty_is_refused():
    refuses(LossConfig, "a finite number >= 0", overlong_penalty=INF)


def test_an_infinite_epsilon_high_is_refused():
    refuses(LossConfig, "a finite number > 0", epsilon_high=INF)


def test_an_infinite_tis_cap_is_refused():
    refuses(LossConfig, "a finite number > 0", tis_cap=INF)


def test_an_infinite_lr_is_refused():
    refuses(OptimizerConfig, "a finite number > 0", lr=INF)


def test_a_negative_min_lr_ratio_is_refused():
    refuses(OptimizerConfig, "a finite number in [0, 1]", min_lr_ratio=-1)
    refuses(OptimizerConfig, "a finite number in [0, 1]", min_lr_ratio=1.5)
    OptimizerConfig(min_lr_ratio=0)  # decay to zero
    OptimizerConfig(min_lr_ratio=1)  # no decay


def test_an_infinite_rollout_temperature_is_refused():
    refuses(RolloutConfig, "a finite number > 0", temperature=INF)
    refuses(RolloutConfig, "a finite number > 0", val_temperature=INF)


@pytest.mark.parametrize(("config_class", "field"), [
    (LossConfig, "epsilon_low"), (LossConfig, "kl_coef"), (LossConfig, "failure_reward"),
    (LossConfig, "overlong_buffer"), (RolloutConfig, "num_generations"), (RolloutConfig, "temperature"),
    (RolloutConfig, "top_k"), (RolloutConfig, "kv_cache_gib"), (OptimizerConfig, "lr"),
    (OptimizerConfig, "warmup_steps"), (OptimizerConfig, "min_lr_ratio"), (LoRAConfig, "rank"), (LoRAConfig, "alpha"),
])
def test_a_bool_is_not_a_number(config_class, field):
    with pytest.raises(ValueError, match=rf"{config_class.__name__}\.{field} = True is invalid"):
        config_class(**{field: True})


@pytest.mark.parametrize(("config_class", "field"), [
    (LossConfig, "mask_truncated"), (LossConfig, "tis"), (RolloutConfig, "dynamic_sampling"),
])
def test_a_switch_is_true_or_false(config_class, field):
    with pytest.raises(ValueError, match=rf"{config_class.__name__}\.{field} = 'yes' is invalid: must be true or false"):
        config_class(**{field: "yes"})


def test_a_choice_outside_its_options_is_refused():
    refuses(LossConfig, "one of 'grpo', 'dr_grpo', 'gspo', 'reinforce_baseline'", type="ppo")
    refuses(LossConfig, "one of 'token', 'sequence'", aggregation="batch")
    refuses(RolloutConfig, "one of 'hf', 'vllm'", engine="sglang")


def test_a_value_outside_its_range_is_refused_naming_the_range():
    refuses(LossConfig, "a finite number in (0, 1]", baseline_weight=1.5)
    refuses(LossConfig, "an integer >= 0", overlong_buffer=-1)
    refuses(RolloutConfig, "a finite number in (0, 1]", top_p=0)
    refuses(RolloutConfig, "a finite number in (0, 1]", gpu_memory_utilization=1.2)
    refuses(RolloutConfig, "an integer >= 1", max_new_tokens=2.5)
    refuses(OptimizerConfig, "2 finite numbers in [0, 1)", betas=(0.9, 1.0))
    refuses(OptimizerConfig, "2 finite numbers in [0, 1)", betas=(0.9,))
    refuses(OptimizerConfig, "a finite number >= 0", weight_decay=-0.1)
    refuses(LoRAConfig, "a finite number in [0, 1)", dropout=1.0)
    refuses(LoRAConfig, "a non-empty list of module names", target_modules=[])


def test_settings_that_need_vllm_say_so():
    refuses(RolloutConfig, "'full' unless engine='vllm'", weight_sync="lowrank")
    RolloutConfig(engine="vllm", weight_sync="lowrank")


def test_a_tool_timeout_past_a_day_is_refused():
    # threading's waits raise OverflowError past threading.TIMEOUT_MAX, at the first tool call.
    refuses(MultiTurnConfig, "a finite number > 0 and <= 86400 (24 h)", tool_timeout_s=1e10)
    refuses(MultiTurnConfig, "a finite number > 0 and <= 86400 (24 h)", tool_timeout_s=86_400.5)
    assert MultiTurnConfig(tool_timeout_s=86_400).tool_timeout_s == 86_400


@pytest.mark.parametrize(("config_class", "field", "value", "allowed"), [
    (BatchingConfig, "micro_batch_size", True, "an integer >= 1"),
    (BatchingConfig, "micro_batch_tokens", 0, "an integer >= 1 or None"),
    (BatchingConfig, "num_iterations", 0, "an integer >= 1"),
    (BatchingConfig, "mini_batches", 0, "an integer >= 1"),
    (BatchingConfig, "logprob_chunk_positions", 0, "an integer >= 1"),
    (LoggingConfig, "completions_every", -1, "an integer >= 0"),
    (LoggingConfig, "completions_count", 0, "an integer >= 1"),
    (LoggingConfig, "val_completions", 1, "true or false"),
    (LoggingConfig, "step_kl", "yes", "true or false"),
    (LoggingConfig, "step_kl_rows", -1, "an integer >= 0"),
])
def test_the_module_groups_check_their_fields(config_class, field, value, allowed):
    refuses(config_class, allowed, **{field: value})
