"""rl/step.py: the one update function GRPOModule and the benchmarks both run, and the one
AdamW both build."""

import torch

from lightning_logra.core.config import LoGRAConfig
from lightning_logra.core.optimizer import LoGRAOptimizer
from lightning_logra.rl import step as rl_step
from lightning_logra.rl.batch import backward_micro_batches
from lightning_logra.rl.config import OptimizerConfig, lr_factor
from lightning_logra.rl.metrics import PassTotals
from lightning_logra.rl.step import build_lr_schedule, build_optimizer, logra_step_inputs, run_update
from tests.helpers.models import tiny_qwen2
from tests.helpers.rollouts import micro_batching, rollout_batch

PROMPTS, COMPLETIONS = [3, 5, 2, 4], [6, 4, 7, 5]  # two prompts x two generations


def batch_and_settings(**batch_options):
    return rollout_batch(PROMPTS, COMPLETIONS, **batch_options), micro_batching(size=2)


def logra(model) -> LoGRAOptimizer:
    return LoGRAOptimizer(model, LoGRAConfig(rank=8, update_ratio=1e-2, kl_budget=1e-4, probe_responses=4))


def update(model, optimizer, batch, settings, *, is_logra: bool, **options):
    return run_update(model, optimizer, batch, slice(0, 4), settings, backward=torch.Tensor.backward,
                      passes=PassTotals.zeros(torch.device("cpu")), num_generations=2, logra=is_logra, **options)


def test_a_logra_update_is_the_backward_then_one_step_with_the_rows_inputs():
    """run_update equals its two halves written out, bit for bit: the same sketches, the same
    report, the same weights."""
    batch, settings = batch_and_settings()
    torch.manual_seed(0)
    by_hand = tiny_qwen2().train()
    by_hand_optimizer = logra(by_hand)
    trained = backward_micro_batches(by_hand, batch, slice(0, 4), settings, backward=torch.Tensor.backward,
                                     passes=PassTotals.zeros(torch.device("cpu")))
    expected = by_hand_optimizer.step(logra_inputs=logra_step_inputs(batch, slice(0, 4), trained, settings,
                                                                     num_generations=2))
    torch.manual_seed(0)
    model = tiny_qwen2().train()
    result = update(model, logra(model), batch, settings, is_logra=True)
    assert torch.equal(result.trainer_logprobs, trained)
    assert result.report.alpha == expected.alpha and result.report.predicted_kl == expected.predicted_kl
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), by_hand.parameters()))


def test_the_step_inputs_probe_one_response_per_prompt_first_and_pair_at_the_sampling_weights():
    batch, settings = batch_and_settings()
    trained = torch.randn(4, batch.mask.shape[1])
    inputs = logra_step_inputs(batch, slice(0, 4), trained, settings, num_generations=2, record_low_rank=True)
    assert torch.equal(inputs.probe.input_ids, batch.rollouts.input_ids[[0, 2, 1, 3]])
    assert inputs.probe.temperature == settings.temperature and inputs.record_low_rank
    assert torch.equal(inputs.logprob_pairs.trainer, trained)  # one update: its own log-probs sampled
    batch.old_logprobs = torch.randn_like(trained)
    inputs = logra_step_inputs(batch, slice(0, 4), trained, settings, num_generations=2)
    assert torch.equal(inputs.logprob_pairs.trainer, batch.old_logprobs)  # later updates: the weights that sampled


def test_a_dense_update_steps_adamw_and_reports_nothing():
    batch, settings = batch_and_settings()
    model = tiny_qwen2().train()
    before = [p.detach().clone() for p in model.parameters()]
    calls = []
    result = update(model, build_optimizer(model.parameters(), OptimizerConfig(lr=1e-2)), batch, settings,
                    is_logra=False, after_backward=lambda: calls.append("backward done"))
    assert result.report is None and calls == ["backward done"]
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_an_update_with_no_token_to_train_on_steps_nothing():
    batch, settings = batch_and_settings(ended_with_eos=[False] * 4, mask_truncated=True)
    model = tiny_qwen2().train()
    optimizer = logra(model)
    assert update(model, optimizer, batch, settings, is_logra=True) is None and optimizer.update_count == 0


def test_build_optimizer_takes_the_trainable_parameters_and_the_configs_settings():
    model = tiny_qwen2()
    model.lm_head.weight.requires_grad_(False)
    config = OptimizerConfig(lr=3e-4, betas=(0.8, 0.9), weight_decay=0.1, warmup_steps=4)
    optimizer = build_optimizer(model.parameters(), config)
    group = optimizer.param_groups[0]
    assert len(group["params"]) == sum(p.requires_grad for p in model.parameters())
    assert (group["lr"], group["betas"], group["weight_decay"]) == (3e-4, (0.8, 0.9), 0.1)
    schedule = build_lr_schedule(optimizer, config)
    assert schedule.get_last_lr() == [3e-4 * lr_factor(0, config)]


def recording_run_update(monkeypatch, module) -> list[bool]:
    """Record each ``run_update`` call (its ``logra`` flag) made through ``module``."""
    calls, original = [], rl_step.run_update
    monkeypatch.setattr(module, "run_update", lambda *a, **k: calls.append(k["logra"]) or original(*a, **k))
    return calls


def test_grpo_module_runs_this_update(monkeypatch, model_folder):
    import lightning_logra.modules.grpo as grpo
    from tests.helpers.grpo import fit_with_reference

    calls = recording_run_update(monkeypatch, grpo)
    fit_with_reference(model_folder, "32-true")
    assert calls == [True]


def test_the_benchmark_harness_runs_this_update_and_adamw(monkeypatch):
    """The benchmarks measure the library's step, not a copy of it."""
    import benchmarks.harness.step as harness

    calls = recording_run_update(monkeypatch, rl_step)  # the harness imports it when it steps
    batch, settings = batch_and_settings()
    replay = harness.Replay(batch, num_generations=2)
    for mode in ("dense", "logra"):
        runner = harness.build_mode(mode, tiny_qwen2(), settings, probe_responses=2, probe_max_tokens=64, rank=8)
        assert runner.step(replay)["step"] > 0
    assert calls == [False, True]
    dense = harness.build_mode("dense", tiny_qwen2(), settings, probe_responses=2, probe_max_tokens=64)
    assert type(dense.optimizer) is torch.optim.AdamW and dense.optimizer.defaults["lr"] == OptimizerConfig().lr
