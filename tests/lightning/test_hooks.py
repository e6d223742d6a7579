"""The typed module <-> strategy contract (lightning_logra.hooks): what a module provides is
checked once at setup, a step's inputs go down with the step and its report comes back, a
misspelt or removed hook is refused."""

import math

import pytest
import torch

from lightning_logra import LoGRAFSDPStrategy, LoGRAModuleHooks, LoGRAOptimizer, LoGRAStepInputs, ProbeBatch
from lightning_logra.hooks import ReportsLoGRASteps, found_hooks
from lightning_logra.modules import GRPOModule
from tests.helpers.lightning import CausalLM, config, loader, token_rows, trainer


class WithOldHook(CausalLM):
    def logra_probe_batch(self):  # the hook of an older version: would silently do nothing
        raise AssertionError("never called")


class WithRemovedHook(CausalLM):
    def logra_step_inputs(self):  # the pull hook the strategy used to call back during a step
        raise AssertionError("never called")


def fixed_probe() -> dict[str, torch.Tensor]:
    rows = torch.arange(20).view(2, 10) % 64
    return {"input_ids": rows, "attention_mask": torch.ones_like(rows), "logits_mask": torch.ones_like(rows, dtype=torch.bool)}


class HandsInputsDown(CausalLM):
    """Manual optimization: each step gets a fixed probe and returns what it did."""

    def __init__(self, inputs=None) -> None:
        super().__init__(manual_micro_batches=1)
        self.inputs = LoGRAStepInputs(probe=fixed_probe()) if inputs is None else inputs
        self.reports = []

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(self.loss(batch))
        self.reports.append(optimizer.step(logra_inputs=self.inputs))


def test_a_logra_method_that_is_no_hook_is_refused_at_setup(tmp_path):
    with pytest.raises(TypeError, match="logra_probe_batch, which is no LoGRA hook; the hooks are logra_model, "
                                        "logra_frozen_models "):
        trainer(LoGRAFSDPStrategy(logra=config(kl_control=True)), max_steps=1, tmp_path=tmp_path).fit(WithOldHook(), loader(4))


def test_the_removed_pull_hook_is_refused_naming_what_replaced_it(tmp_path):
    with pytest.raises(TypeError, match=r"WithRemovedHook defines logra_step_inputs\(\) was removed: .*"
                                        r"self.optimizers\(\).step\(logra_inputs=LoGRAStepInputs\(...\)\)"):
        trainer(LoGRAFSDPStrategy(logra=config(kl_control=True)), max_steps=1,
                tmp_path=tmp_path).fit(WithRemovedHook(), loader(4))


def test_each_step_returns_the_report_of_the_inputs_handed_to_it(tmp_path):
    module = HandsInputsDown()
    strategy = LoGRAFSDPStrategy(logra=config(kl_control=True))
    trainer(strategy, max_steps=3, tmp_path=tmp_path).fit(module, loader(4))
    assert [report.update for report in module.reports] == [0, 1, 2]
    assert module.reports[-1] is strategy.last_report  # what observers such as LoGRACallback read
    assert all(report.budget is not None and report.predicted_kl > 0 for report in module.reports)
    assert strategy.runtime.describe(module).endswith("; no module hooks (defaults)")


@pytest.mark.parametrize("handed_down", [True, False])
def test_the_probe_handed_down_is_scored_else_the_training_batch(tmp_path, monkeypatch, handed_down):
    probed = []
    predict = LoGRAOptimizer.predict_kl
    monkeypatch.setattr(LoGRAOptimizer, "predict_kl", lambda self, probe, *a: probed.append(probe) or predict(self, probe, *a))
    module = HandsInputsDown(inputs=None if handed_down else LoGRAStepInputs())
    trainer(LoGRAFSDPStrategy(logra=config(kl_control=True)), max_steps=1, tmp_path=tmp_path).fit(module, loader(4))
    expected = fixed_probe()["input_ids"] if handed_down else token_rows()[:4]
    # The default stratified probe: up to 8 rows, here every row, each standing for itself.
    assert len(probed) == 1 and torch.equal(probed[0].input_ids, expected)
    assert probed[0].row_weights.tolist() == [1.0] * len(expected)


def test_the_grpo_module_provides_every_hook(model_folder):
    module = GRPOModule(model=model_folder)
    assert isinstance(module, LoGRAModuleHooks)
    assert found_hooks(module) == ["logra_model", "logra_frozen_models"]


def test_only_the_logra_strategies_take_step_inputs(tmp_path):
    module = CausalLM()
    trainer("auto", max_steps=1, tmp_path=tmp_path).fit(module, loader(4))
    assert not isinstance(module.trainer.strategy, ReportsLoGRASteps)
    assert isinstance(LoGRAFSDPStrategy(), ReportsLoGRASteps)


@pytest.mark.parametrize("tokens", [0, -1, math.nan, math.inf])
def test_step_inputs_refuse_a_token_count_that_is_no_count(tokens):
    with pytest.raises(ValueError, match="LoGRAStepInputs.normalization_tokens"):
        LoGRAStepInputs(normalization_tokens=tokens)


def test_step_inputs_take_a_probe_dict_and_plain_pairs():
    rows = torch.ones(1, 4, dtype=torch.long)
    inputs = LoGRAStepInputs(probe={"input_ids": rows, "attention_mask": rows, "logits_mask": rows},
                             logprob_pairs=(torch.zeros(1, 3), torch.zeros(1, 3), torch.ones(1, 3)))
    assert isinstance(inputs.probe, ProbeBatch) and inputs.probe.logits_mask.dtype == torch.bool
    assert inputs.logprob_pairs.mask.shape == (1, 3)
    with pytest.raises(TypeError, match="LoGRAStepInputs.probe must be a ProbeBatch or a mapping"):
        LoGRAStepInputs(probe=rows)
    with pytest.raises(TypeError, match="record_low_rank must be a bool"):
        LoGRAStepInputs(record_low_rank=1)


def test_step_inputs_of_another_type_are_refused(tmp_path):
    module = HandsInputsDown(inputs={"probe": None})
    with pytest.raises(TypeError, match="optimizer.step\\(logra_inputs=...\\) takes a LoGRAStepInputs, got dict"):
        trainer(LoGRAFSDPStrategy(logra=config()), max_steps=1, tmp_path=tmp_path).fit(module, loader(4))
