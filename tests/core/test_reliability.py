"""Faults never corrupt a run: non-finite steps are skipped or raised, out-of-memory errors
name their phase (ranks that disagree: tests/integration/test_reliability_two_ranks.py)."""

import pytest
import torch

from lightning_logra import LoGRAOptimizer
from tests.helpers.lightning import PoisonedLoss, config, fit_recording_warnings


def test_a_non_finite_step_is_skipped_without_touching_weights():
    module = PoisonedLoss(poisoned_steps=[1])
    strategy, messages = fit_recording_warnings(module, config(), steps=3)
    before, during, after = module.weights_after_step
    assert all(torch.equal(a, b) for a, b in zip(before, during))  # step 1 changed nothing
    assert not all(torch.equal(a, b) for a, b in zip(during, after))  # and training went on
    assert strategy.logra_optimizer.skipped_steps == 1 and strategy.logra_optimizer.update_count == 2
    assert any("skipped a step (1 so far" in message for message in messages)


def test_too_many_consecutive_skips_stop_the_run():
    with pytest.raises(FloatingPointError, match="skipped 2 consecutive steps"):
        fit_recording_warnings(PoisonedLoss(poisoned_steps=[0, 1, 2]), config(max_consecutive_skips=2), steps=3)


def test_on_nonfinite_raise_raises_at_once():
    module = PoisonedLoss(poisoned_steps=[1])
    with pytest.raises(FloatingPointError, match="non-finite values in the sketch"):
        fit_recording_warnings(module, config(on_nonfinite="raise"), steps=3)
    assert len(module.weights_after_step) == 1


def test_out_of_memory_names_the_phase_and_changes_no_weight(monkeypatch):
    def exhausted(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(LoGRAOptimizer, "apply_update", exhausted)
    module = PoisonedLoss(poisoned_steps=[])
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(torch.OutOfMemoryError, match="during the update phase.*logra.update_chunk_rows.*Tried to allocate"):
        fit_recording_warnings(module, config(), steps=1)
    after = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in module.state_dict().items()}
    assert all(torch.equal(before[k], after[k]) for k in before)
