"""logra_fsdp with the Trainer and Fabric: same weights as the plain-torch engine."""

import warnings

import lightning as L
import pytest
import torch

import lightning_logra
from lightning_logra import LoGRAFabricStrategy, LoGRAFSDPStrategy
from tests.distributed import run_lightning_on_two_ranks
from tests.lightning_helpers import (
    CausalLM,
    config,
    dataset,
    loader,
    reference_weights,
    trained_weights,
    trainer,
)

# FSDP2's all-gathered weights compute exactly what the plain weights compute; with two
# ranks the sketch is a mean of two half-batch sketches: float32 round-off.
TWO_RANK_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


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
    with pytest.raises(ValueError, match="logra_step_inputs"):
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
    weights = _fabric_loop(fabric, rank=0, world=1)
    for weight, expected in zip(weights, reference_weights(3, 4, config())):
        torch.testing.assert_close(weight, expected, rtol=0, atol=0)


def _fabric_loop(fabric, rank, world):
    module = CausalLM()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = fabric.setup_module(module)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
        rows = torch.stack([row["input_ids"] for row in dataset()])
        for step in range(3):
            batch = rows[step * 4 : (step + 1) * 4].chunk(world)[rank]
            fabric.backward(module.loss({"input_ids": batch, "attention_mask": torch.ones_like(batch)}))
            optimizer.step()
            optimizer.zero_grad()
    return trained_weights(fabric.strategy)


def _sharded(strategy) -> bool:
    """Whether FSDP2 shards the policy: every parameter a DTensor, the start line saying so."""
    from torch.distributed.tensor import DTensor

    policy = strategy.logra_optimizer.model
    every_parameter_sharded = all(isinstance(p, DTensor) for p in policy.parameters())
    return every_parameter_sharded and "; FSDP2 shards the policy over 2 ranks;" in strategy.runtime.describe(policy)


def _two_rank_runs(rank, world):
    import lightning as L

    results = {}
    for reduction in ("all_reduce", "reduce_scatter"):
        strategy = LoGRAFSDPStrategy(logra=config(sketch_reduction=reduction))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer(strategy, max_steps=3, devices=2).fit(CausalLM(), loader(2, rank=rank, world=world))
        results[f"trainer/{reduction}"] = (strategy.logra_optimizer.layout.name, _sharded(strategy), trained_weights(strategy))
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=LoGRAFabricStrategy(logra=config()))
    fabric.launch()
    weights = _fabric_loop(fabric, rank, world)
    results["fabric/auto"] = (fabric.strategy.logra_optimizer.layout.name, _sharded(fabric.strategy), weights)
    return results


@pytest.mark.distributed
def test_two_devices_shard_the_policy_and_equal_the_plain_engine_for_trainer_and_fabric():
    results = run_lightning_on_two_ranks(_two_rank_runs)
    expected = reference_weights(3, 4, config())
    for name, (reduction, sharded, weights) in results[0].items():
        assert reduction == name.split("/")[1].replace("auto", "reduce_scatter"), name
        assert sharded, name
        for weight, reference in zip(weights, expected):
            torch.testing.assert_close(weight, reference, **TWO_RANK_TOLERANCE, msg=name)


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
