"""End-to-end: GRPOModule fits a tiny random Qwen2 with LoGRA, dense AdamW and LoRA."""

import re
import warnings

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
import pytest
import torch

from lightning_logra import LoGRACallback, LoGRAConfig, LoGRAFSDPStrategy
from lightning_logra.modules import (BatchingConfig, GRPOModule, LoggingConfig, LoRAConfig, LossConfig, OptimizerConfig,
                                     RewardConfig, RolloutConfig)
from lightning_logra.modules.grpo import DEPRECATED_ALIASES
from lightning_logra.rewards.runner import RewardRunner
from lightning_logra.rl.config import lr_factor
from lightning_logra.rl import step as rl_step
from tests.helpers.grpo import fit_grpo, grpo_module, prompt_data

LOGGED = {"reward/mean", "reward/std", "reward/zero_std_groups", "reward/failures", "completion/length_mean",
          "completion/length_max", "completion/clipped_fraction", "policy/entropy", "policy/clip_fraction",
          "policy/rollout_trainer_logprob_gap", "perf/tokens_per_second", "perf/generation_s", "perf/rewards_s",
          "perf/forward_backward_s", "perf/optimizer_step_s", "perf/weight_sync_s"}


def fit(grpo, folder, strategy="auto", steps=2, **options):
    grpo.configure_model()  # the weights now, to compare with after the fit (the fit keeps them)
    snapshot = {name: p.detach().clone() for name, p in grpo.policy.named_parameters()}
    logged = {}

    class Capture(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            logged.update({k: float(v) for k, v in trainer.callback_metrics.items()})

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  limit_val_batches=0, callbacks=[Capture(), *options.pop("callbacks", [])], **options).fit(grpo, prompt_data(folder))
    changed = set()
    for name, parameter in grpo.policy.named_parameters():
        value = parameter.full_tensor() if hasattr(parameter, "full_tensor") else parameter.detach()
        if not torch.equal(value, snapshot[name]):
            changed.add(name)
    return changed, logged


def test_logra_changes_exactly_the_target_weights(model_folder):
    grpo = grpo_module(model_folder)
    strategy = LoGRAFSDPStrategy(logra=LoGRAConfig(rank=8, update_ratio=1e-3))
    changed, logged = fit(grpo, model_folder, strategy=strategy, callbacks=[LoGRACallback()])
    targets = {f"{state.name}.weight" for state in strategy.logra_optimizer.sketches}
    assert len(targets) == 14 and changed == targets
    assert LOGGED | {"logra/alpha", "logra/predicted_kl", "logra/mismatch", "perf/logra_probe_s"} <= set(logged)
    assert strategy.logra_optimizer.update_count == 2


def test_logra_under_bf16_mixed_precision_probes_and_updates(model_folder):
    # GRPOModule steps its optimizer inside training_step, so the KL probe runs under the
    # precision plugin's autocast: float32 residual inputs, bfloat16 layer outputs.
    grpo = grpo_module(model_folder)
    strategy = LoGRAFSDPStrategy(logra=LoGRAConfig(rank=8, update_ratio=1e-3))
    changed, logged = fit(grpo, model_folder, strategy=strategy, precision="bf16-mixed", callbacks=[LoGRACallback(measure_kl=True)])
    assert changed == {f"{state.name}.weight" for state in strategy.logra_optimizer.sketches}
    assert strategy.logra_optimizer.update_count == 2 and strategy.logra_optimizer.skipped_steps == 0
    assert logged["logra/predicted_kl"] > 0 and logged["logra/measured_kl"] > 0
    assert all(p.dtype == torch.float32 for p in grpo.policy.parameters())  # master weights stay float32


@pytest.mark.parametrize("follow", [False, True])
def test_logra_step_size_ignores_the_lr_schedule_unless_asked(model_folder, follow):
    # GRPOModule's default schedule warms up over 9 steps: lr / initial lr = 1/9 at step 0.
    grpo = grpo_module(model_folder, optimizer=OptimizerConfig())
    strategy = LoGRAFSDPStrategy(logra=LoGRAConfig(rank=8, follow_lr_schedule=follow))
    fit(grpo, model_folder, strategy=strategy, steps=1)
    report = strategy.last_report
    expected = 6e-5 * (lr_factor(0, OptimizerConfig()) if follow else 1.0)  # the reference keeps 6e-5
    assert report.update_ratio == pytest.approx(expected, rel=1e-12)
    assert report.update_norm == pytest.approx(expected * report.weight_norm, rel=1e-9)


def test_probe_batch_answers_different_prompts_at_the_sampling_temperature(model_folder, monkeypatch):
    grpo = grpo_module(model_folder, rollout=RolloutConfig(num_generations=2, max_new_tokens=6, temperature=0.7))
    strategy = LoGRAFSDPStrategy(logra=LoGRAConfig(rank=8))
    probes, rollout_rows, step_inputs = [], [], rl_step.logra_step_inputs

    def recorded_step_inputs(batch, rows, *args, **kwargs):
        rollout_rows.append(batch.rollouts.input_ids[rows])
        probes.append(step_inputs(batch, rows, *args, **kwargs).probe)
        return step_inputs(batch, rows, *args, **kwargs)

    monkeypatch.setattr(rl_step, "logra_step_inputs", recorded_step_inputs)
    fit(grpo, model_folder, strategy=strategy, steps=1)
    probe = probes[-1]
    assert probe.temperature == 0.7
    rows = rollout_rows[-1]  # group layout: [p0 g0, p0 g1, p1 g0, p1 g1]
    assert torch.equal(probe.input_ids, rows[[0, 2, 1, 3]])  # one sample of each prompt first
    assert strategy.last_report.budget is not None and not strategy.last_report.skipped


def test_dense_adamw_changes_every_weight(model_folder):
    grpo = grpo_module(model_folder, activation_checkpointing=False)
    changed, logged = fit(grpo, model_folder)
    names = {name for name, _ in grpo.policy.named_parameters()}
    # the embedding of tokens never sampled keeps its rows, but every tensor moves
    assert changed == names
    assert LOGGED <= set(logged)


def eval_mode_notices(grpo, folder, callbacks=()) -> list[str]:
    caught = []
    fit_grpo(grpo, folder, steps=1, caught_warnings=caught, callbacks=callbacks)
    return [str(w.message) for w in caught if "in eval mode at the start of training" in str(w.message)]


def test_a_frozen_reference_raises_no_eval_mode_notice_but_a_policy_module_left_in_eval_does(model_folder):
    assert eval_mode_notices(grpo_module(model_folder, loss=LossConfig(kl_coef=0.1)), model_folder) == []

    class PolicyNormInEval(L.Callback):
        def on_fit_start(self, trainer, grpo):  # callbacks' hooks run before the module's
            grpo.policy.model.norm.eval()

    grpo = grpo_module(model_folder, loss=LossConfig(kl_coef=0.1))
    notices = eval_mode_notices(grpo, model_folder, callbacks=[PolicyNormInEval()])
    reference_modules = sum(1 for _ in grpo.reference.modules())
    assert len(notices) == 1 and notices[0].startswith(f"Found {reference_modules + 1} module(s) in eval mode")


def test_step_checkpoints_raise_no_notice_about_the_state_after_the_step(model_folder, tmp_path):
    grpo = grpo_module(model_folder)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                  enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path,
                  callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_last=True)]
                  ).fit(grpo, prompt_data(model_folder))
    assert (tmp_path / "last.ckpt").exists()
    assert not [w for w in caught if "manual optimization and every_n_train_steps" in str(w.message)]


def test_lora_changes_only_the_adapters(model_folder):
    grpo = grpo_module(model_folder, lora=LoRAConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"]))
    changed, _ = fit(grpo, model_folder)
    trainable = {name for name, p in grpo.policy.named_parameters() if p.requires_grad}
    assert len(trainable) == 8 and all("lora_" in name for name in trainable)
    # peft initialises B = 0, so A's gradient is zero until B has moved: B always changes
    assert {name for name in trainable if "lora_B" in name} <= changed <= trainable


@pytest.mark.parametrize("loss", [LossConfig(type="reinforce_baseline"), LossConfig(type="dr_grpo"),
                                  LossConfig(type="grpo", aggregation="sequence", kl_coef=0.1)])
def test_other_losses_move_the_weights_and_log_their_metrics(model_folder, loss):
    grpo = grpo_module(model_folder, loss=loss)
    changed, logged = fit(grpo, model_folder, steps=1)
    assert changed and "reward/mean" in logged
    if loss.type == "reinforce_baseline":
        assert grpo.baseline.value != 0.0  # rewards <= 0 are shaped to -0.01
    if loss.kl_coef:
        assert "policy/kl" in logged


def test_validation_logs_pass_at_1_and_n(model_folder):
    grpo = grpo_module(model_folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                            enable_model_summary=False).validate(grpo, prompt_data(model_folder))
    assert set(results[0]) == {"val/pass_at_1", "val/pass_at_2"}
    assert 0.0 <= results[0]["val/pass_at_1"] <= results[0]["val/pass_at_2"] <= 1.0


def test_learning_rate_schedule_is_warmup_then_cosine():
    config = OptimizerConfig(warmup_steps=9, decay_steps=300, min_lr_ratio=0.1)
    assert lr_factor(0, config) == pytest.approx(1 / 9)
    assert lr_factor(8, config) == pytest.approx(1.0)
    assert lr_factor(9, config) == pytest.approx(1.0)
    assert lr_factor(300, config) == pytest.approx(0.1)
    assert lr_factor(1000, config) == pytest.approx(0.1)
    assert lr_factor(5, OptimizerConfig(warmup_steps=0, decay_steps=0)) == 1.0


def test_invalid_settings_name_the_field(model_folder):
    with pytest.raises(ValueError, match=r"RolloutConfig.num_generations = 0 is invalid: must be an integer >= 1"):
        RolloutConfig(num_generations=0)
    with pytest.raises(ValueError, match=r"LossConfig.tis_cap = 0 is invalid: must be a finite number > 0"):
        LossConfig(tis_cap=0)
    with pytest.raises(ValueError, match=r"GRPOModule.rollout.engine = 'vllm' is invalid: must be 'hf' with lora"):
        grpo_module(model_folder, rollout=RolloutConfig(engine="vllm"), lora=LoRAConfig())


@pytest.mark.parametrize(("argument", "value", "allowed"), [
    ("seed", -1, "an integer >= 0"),
    ("activation_checkpointing", 1, "true or false"),
])
def test_module_arguments_are_checked_like_config_fields(model_folder, argument, value, allowed):
    with pytest.raises(ValueError, match=rf"GRPOModule\.{argument} = {re.escape(repr(value))} is invalid: "
                                         rf"must be {re.escape(allowed)}"):
        grpo_module(model_folder, **{argument: value})


TWO_REWARDS = ["tests.helpers.grpo:zero_reward", "tests.helpers.grpo:varied_reward"]
# Each family of deprecated flat names (logprob_chunk_size was renamed twice): values given
# under the old names, and the group that gives them under the new ones.
FLAT_NAMES = {
    "reward": ({"rewards": TWO_REWARDS, "reward_weights": [1.0, 0.5], "reward_timeout_s": 20.0,
                "reward_max_consecutive_timeouts": 5},
               RewardConfig(functions=TWO_REWARDS, weights=[1.0, 0.5], timeout_s=20.0, max_consecutive_timeouts=5)),
    "batching": ({"micro_batch_size": 2, "micro_batch_tokens": 64, "num_iterations": 2, "mini_batches": 2,
                  "logprob_chunk_positions": 32},
                 BatchingConfig(micro_batch_size=2, micro_batch_tokens=64, num_iterations=2, mini_batches=2,
                                logprob_chunk_positions=32)),
    "logging": ({"log_completions_every": 2, "log_completions_count": 3, "log_val_completions": True,
                 "measure_step_kl": True},
                LoggingConfig(completions_every=2, completions_count=3, val_completions=True, step_kl=True)),
    "logprob_chunk_size": ({"logprob_chunk_size": 64}, BatchingConfig(logprob_chunk_positions=64)),
}


def runner_settings(runner: RewardRunner) -> tuple:
    return runner.names, runner.weights, runner.timeout_s, runner.max_consecutive_timeouts


@pytest.mark.parametrize("family", FLAT_NAMES)
def test_deprecated_flat_names_warn_once_each_and_set_their_group(model_folder, family, no_alias_warned_yet):
    flat, group = FLAT_NAMES[family]
    name = type(group).__name__.removesuffix("Config").lower()
    with pytest.warns(FutureWarning) as caught:
        grpo = GRPOModule(model=model_folder, **flat)
    assert sorted(str(w.message) for w in caught) == sorted(
        f"GRPOModule.{old} is deprecated: use {DEPRECATED_ALIASES[old]} (same meaning; the old name will be removed)"
        for old in flat)
    new = GRPOModule(model=model_folder, **{name: group})
    assert getattr(grpo, name) == group and grpo.hparams[name] == group and not set(flat) & set(grpo.hparams)
    assert grpo._micro_batching == new._micro_batching
    assert runner_settings(grpo.reward_runner) == runner_settings(new.reward_runner)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GRPOModule(model=model_folder, **flat)  # each warned once already


def test_deprecated_flat_names_read_their_group_fields_as_attributes(model_folder, no_alias_warned_yet):
    grpo = grpo_module(model_folder, logging=LoggingConfig(step_kl=True))
    with pytest.warns(FutureWarning, match=r"GRPOModule\.micro_batch_size is deprecated: use batching\."):
        assert grpo.micro_batch_size == 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        for old, new in DEPRECATED_ALIASES.items():
            group, field = new.split(".")
            assert getattr(grpo, old) == getattr(getattr(grpo, group), field), old
        assert grpo.measure_step_kl is True and grpo.rewards == ["tests.helpers.grpo:varied_reward"]
    with pytest.raises(AttributeError, match=r"GRPOModule\.micro_batch_size is deprecated and read-only: set "
                                             r"batching\.micro_batch_size"):
        grpo.micro_batch_size = 8


def test_a_flat_name_and_its_field_set_to_another_value_raise_naming_both(model_folder):
    with pytest.raises(ValueError, match=r"GRPOModule\.micro_batch_size = 8 and GRPOModule\.batching\.micro_batch_size "
                                         r"= 2 are both given: .* give batching\.micro_batch_size only"):
        GRPOModule(model=model_folder, batching=BatchingConfig(micro_batch_size=2), micro_batch_size=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with pytest.raises(ValueError, match=r"GRPOModule\.logprob_chunk_size = 64 and "
                                             r"GRPOModule\.logprob_chunk_positions = 32 are both given"):
            GRPOModule(model=model_folder, logprob_chunk_positions=32, logprob_chunk_size=64)
        # Another field of the group, or the same value: no conflict.
        grpo = GRPOModule(model=model_folder, batching=BatchingConfig(mini_batches=2, num_iterations=3),
                          micro_batch_size=8, num_iterations=3)
    assert grpo.batching == BatchingConfig(micro_batch_size=8, mini_batches=2, num_iterations=3)
