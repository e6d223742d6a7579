"""The typed module <-> strategy contract (lightning_logra.hooks): what a module provides is
checked once at setup, a step asks for its inputs once, a misspelt hook is refused."""

import math

import pytest
import torch

from lightning_logra import LoGRAFSDPStrategy, LoGRAModuleHooks, LoGRAStepInputs, ProbeBatch
from lightning_logra.hooks import found_hooks, last_step_report
from lightning_logra.modules import GRPOModule
from tests.helpers.lightning import CausalLM, config, loader, trainer


class WithOldHook(CausalLM):
    def logra_probe_batch(self):  # the hook of an older version: would silently do nothing
        raise AssertionError("never called")


class CountingInputs(CausalLM):
    """Probes a fixed batch and counts how often the strategy asks for the step's inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def logra_step_inputs(self) -> LoGRAStepInputs:
        self.calls += 1
        rows = torch.arange(20).view(2, 10) % 64
        return LoGRAStepInputs(probe={"input_ids": rows, "attention_mask": torch.ones_like(rows),
                                      "logits_mask": torch.ones_like(rows, dtype=torch.bool)})


def test_a_logra_method_that_is_no_hook_is_refused_at_setup(tmp_path):
    with pytest.raises(TypeError, match="logra_probe_batch, which is no LoGRA hook; the hooks are logra_model, "
                                        "logra_frozen_models, logra_step_inputs"):
        trainer(LoGRAFSDPStrategy(logra=config(kl_control=True)), max_steps=1, tmp_path=tmp_path).fit(WithOldHook(), loader(4))


def test_step_inputs_are_asked_once_per_optimizer_step_and_the_start_line_names_the_hooks(tmp_path):
    module = CountingInputs()
    strategy = LoGRAFSDPStrategy(logra=config(kl_control=True))
    trainer(strategy, max_steps=3, tmp_path=tmp_path).fit(module, loader(4))
    assert module.calls == 3
    assert strategy.runtime.describe(module).endswith("; module hooks: logra_step_inputs")
    report = last_step_report(module.trainer)
    assert report is strategy.last_report and report.budget is not None and report.low_rank_updates is None


def test_the_grpo_module_provides_every_hook(model_folder):
    module = GRPOModule(model=model_folder)
    assert isinstance(module, LoGRAModuleHooks)
    assert found_hooks(module) == ["logra_model", "logra_frozen_models", "logra_step_inputs"]
    with pytest.raises(RuntimeError, match="during an optimizer step only"):
        module.logra_step_inputs()


def test_no_step_report_under_another_strategy(tmp_path):
    module = CausalLM()
    trainer("auto", max_steps=1, tmp_path=tmp_path).fit(module, loader(4))
    assert last_step_report(module.trainer) is None


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


def test_a_hook_returning_something_else_is_refused(tmp_path):
    class Untyped(CausalLM):
        def logra_step_inputs(self):
            return {"probe": None}

    with pytest.raises(TypeError, match=r"Untyped.logra_step_inputs\(\) returned dict, not a LoGRAStepInputs"):
        trainer(LoGRAFSDPStrategy(logra=config()), max_steps=1, tmp_path=tmp_path).fit(Untyped(), loader(4))
