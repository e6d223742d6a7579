"""logra_fsdp with the Trainer and Fabric on one device: same weights as the plain-torch engine
(on two: tests/integration/test_strategy_two_ranks.py)."""

import lightning as L
import pytest
import torch

import lightning_logra
from lightning_logra import LoGRAFabricStrategy, LoGRAFSDPStrategy
from tests.helpers.lightning import (
    CausalLM,
    config,
    dataset,
    fabric_loop,
    loader,
    reference_weights,
    trained_weights,
    trainer,
)

def test_importing_the_package_registers_the_name_in_both_registries():
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    assert StrategyRegistry["logra_fsdp"]["strategy"] is LoGRAFSDPStrategy
    assert STRATEGY_REGISTRY["logra_fsdp"]["strategy"] is LoGRAFabricStrategy
    assert lightning_logra.LoGRAFSDPStrategy is LoGRAFSDPStrategy


def test_trainer_by_name_scales_an_ordinary_module_to_the_kl_budget_without_a_callback(tmp_path):
    module = CausalLM()
    trainer(strategy="logra_fsdp", max_steps=2, tmp_path=tmp_path).fit(module, loader(4))
    strategy = module.trainer.strategy
    assert isinstance(strategy, LoGRAFSDPStrategy)
    assert strategy.logra_optimizer.update_count == 2
    report = strategy.last_report  # probed on the training batch: the controller is in the core
    assert report.update == 1 and not report.skipped and report.predicted_kl > 0
    assert report.alpha == pytest.approx(min(3.0, (report.budget / report.predicted_kl) ** 0.5), rel=1e-12)


class TupleBatches(CausalLM):
    def training_step(self, batch, batch_idx):
        return super().training_step({"input_ids": batch[0], "attention_mask": torch.ones_like(batch[0])}, batch_idx)


def test_kl_control_without_probe_data_names_the_fix(tmp_path):
    rows = [(row["input_ids"],) for row in dataset(8)]
    with pytest.raises(ValueError, match=r"step\(logra_inputs=LoGRAStepInputs\(probe="):
        trainer(LoGRAFSDPStrategy(), max_steps=1, tmp_path=tmp_path).fit(TupleBatches(), torch.utils.data.DataLoader(rows, batch_size=4))


@pytest.mark.parametrize("reduction", ["all_reduce", "reduce_scatter"])
def test_trainer_one_device_equals_the_plain_engine(tmp_path, reduction):
    logra = config(sketch_reduction=reduction)
    strategy = LoGRAFSDPStrategy(logra=logra)
    trainer(strategy, max_steps=3, tmp_path=tmp_path).fit(CausalLM(), loader(4))
    for weight, expected in zip(trained_weights(strategy), reference_weights(3, 4, config())):
        torch.testing.assert_close(weight, expected, rtol=0, atol=0)


def test_accumulate_grad_batches_equals_manual_micro_batches(tmp_path):
    automatic = LoGRAFSDPStrategy(logra=config())
    trainer(automatic, max_steps=2, tmp_path=tmp_path, accumulate_grad_batches=2).fit(CausalLM(), loader(2))
    manual = LoGRAFSDPStrategy(logra=config())
    trainer(manual, max_steps=2, tmp_path=tmp_path).fit(CausalLM(manual_micro_batches=2), loader(4))
    expected = reference_weights(2, 4, config(), micro_batches=2)
    # automatic mode sums two mean losses, manual mode two halves: same sketch up to a factor
    # of 2 that RowAdam and the global norm remove (float32 round-off only)
    for a, m, e in zip(trained_weights(automatic), trained_weights(manual), expected):
        torch.testing.assert_close(m, e, rtol=0, atol=0)
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-7)


def test_fabric_one_device_equals_the_plain_engine():
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=LoGRAFabricStrategy(logra=config()))
    fabric.launch()
    weights = fabric_loop(fabric, rank=0, world=1)
    for weight, expected in zip(weights, reference_weights(3, 4, config())):
        torch.testing.assert_close(weight, expected, rtol=0, atol=0)


def test_model_summary_and_start_line_count_what_logra_trains(tmp_path, monkeypatch):
    from lightning.pytorch.callbacks import ModelSummary

    from lightning_logra.callbacks import LoGRAModelSummary

    printed = []  # the trainable count Lightning's summary table is given
    monkeypatch.setattr(ModelSummary, "summarize", staticmethod(lambda data, total, trainable, *a, **k: printed.append(trainable)))
    module = CausalLM()
    total = sum(p.numel() for p in module.parameters())
    strategy = LoGRAFSDPStrategy(logra=config())
    fitted = trainer(strategy, max_steps=1, tmp_path=tmp_path, enable_model_summary=True, callbacks=[LoGRAModelSummary()])
    fitted.fit(module, loader(4))
    targets = sum(state.weight.numel() for state in strategy.logra_optimizer.sketches)
    assert printed == [targets] and targets > 0  # not the "0" of frozen-for-autograd weights
    assert strategy.runtime.describe(module) == (
        f"LoGRA trains {targets:,} parameters in 14 target layers (q_proj, k_proj, v_proj, o_proj, gate_proj, "
        f"up_proj, down_proj) through rank-8 sketches; the other {total - targets:,} parameters are frozen; "
        "one device: the policy is not wrapped in FSDP2; no module hooks (defaults)"
    )
