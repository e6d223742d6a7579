"""Faults never corrupt a run: non-finite steps are skipped or raised, ranks must agree,
out-of-memory errors name their phase."""

import warnings

import pytest
import torch

from lightning_logra import LoGRACallback, LoGRAFSDPStrategy, LoGRAOptimizer
from lightning_logra.core.reliability import verify_ranks_agree
from tests.distributed import run_lightning_on_two_ranks, run_on_two_ranks
from tests.lightning_helpers import CausalLM, config, loader, trained_weights, trainer


class PoisonedLoss(CausalLM):
    """Returns a NaN loss on the chosen steps (on one rank only, if ``rank`` is set)."""

    def __init__(self, poisoned_steps, rank=None):
        super().__init__()
        self.poisoned_steps = set(poisoned_steps)
        self.poisoned_rank = rank
        self.weights_after_step = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_step in self.poisoned_steps and self.poisoned_rank in (None, self.global_rank):
            loss = loss * float("nan")
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.weights_after_step.append(trained_weights(self.trainer.strategy))


def fit(module, logra, steps, devices=1, rank=0, world=1):
    strategy = LoGRAFSDPStrategy(logra=logra)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(strategy, max_steps=steps, devices=devices, callbacks=[LoGRACallback(log_memory=False)]).fit(
            module, loader(4 // world, rank=rank, world=world))
    return strategy, [str(w.message) for w in caught]


def test_a_non_finite_step_is_skipped_without_touching_weights():
    module = PoisonedLoss(poisoned_steps=[1])
    strategy, messages = fit(module, config(), steps=3)
    before, during, after = module.weights_after_step
    assert all(torch.equal(a, b) for a, b in zip(before, during))  # step 1 changed nothing
    assert not all(torch.equal(a, b) for a, b in zip(during, after))  # and training went on
    assert strategy.logra_optimizer.skipped_steps == 1 and strategy.logra_optimizer.update_count == 2
    assert any("skipped a step (1 so far" in message for message in messages)


def test_too_many_consecutive_skips_stop_the_run():
    with pytest.raises(FloatingPointError, match="skipped 2 consecutive steps"):
        fit(PoisonedLoss(poisoned_steps=[0, 1, 2]), config(max_consecutive_skips=2), steps=3)


def test_on_nonfinite_raise_raises_at_once():
    module = PoisonedLoss(poisoned_steps=[1])
    with pytest.raises(FloatingPointError, match="non-finite values in the sketch"):
        fit(module, config(on_nonfinite="raise"), steps=3)
    assert len(module.weights_after_step) == 1


def _poison_one_rank(rank, world):
    module = PoisonedLoss(poisoned_steps=[1], rank=1)
    strategy, _ = fit(module, config(), steps=3, devices=2, rank=rank, world=world)
    optimizer = strategy.logra_optimizer
    return {
        "skipped": strategy.logra_optimizer.skipped_steps,
        "updates": optimizer.update_count,
        "unchanged_at_nan_step": all(torch.equal(a, b) for a, b in zip(*module.weights_after_step[:2])),
        "projection": optimizer.sketches.states[0].projection.clone(),
        "weights": module.weights_after_step[-1],
    }


@pytest.mark.distributed
def test_nan_on_one_rank_of_two_is_skipped_on_both():
    first, second = run_lightning_on_two_ranks(_poison_one_rank)
    for result in (first, second):
        assert result["skipped"] == 1 and result["updates"] == 2 and result["unchanged_at_nan_step"]
    assert torch.equal(first["projection"], second["projection"])
    assert all(torch.equal(a, b) for a, b in zip(first["weights"], second["weights"]))


def _disagreeing_ranks(rank, world, what):
    from tests.tiny_models import tiny_qwen2

    logra = config(seed=rank) if what == "config" else config()
    optimizer = LoGRAOptimizer(tiny_qwen2(), logra)
    if what == "projection" and rank == 1:
        optimizer.sketches.states[3].projection.neg_()
    try:
        verify_ranks_agree(optimizer.sketches, logra.to_dict())
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.distributed
def test_ranks_that_derived_different_projections_or_configs_are_an_error():
    messages = run_on_two_ranks(_disagreeing_ranks, "projection")
    assert messages[0] == messages[1] == (
        "ranks disagree: rank 1 and rank 0 derived different the projection of layer model.layers.0.self_attn.o_proj"
    )
    assert "different the LoGRA configuration" in run_on_two_ranks(_disagreeing_ranks, "config")[0]


def test_out_of_memory_names_the_phase_and_changes_no_weight(monkeypatch):
    def exhausted(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(LoGRAOptimizer, "apply_update", exhausted)
    module = PoisonedLoss(poisoned_steps=[])
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(torch.OutOfMemoryError, match="during the update phase.*logra.update_chunk_rows.*Tried to allocate"):
        fit(module, config(), steps=1)
    after = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in module.state_dict().items()}
    assert all(torch.equal(before[k], after[k]) for k in before)
