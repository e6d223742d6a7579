"""A LoGRA update sent as (alpha D, seed of A): a copy of the weights that applies it follows
the trainer's bit for bit, for a fraction of a full weight's bytes."""

import pytest
import torch

from lightning_logra import LoGRAStepInputs, ProbeBatch
from tests.helpers.core import backward, qwen2_and_optimizer, weights


@pytest.mark.parametrize("redraw_projections", [True, False])
def test_low_rank_updates_reproduce_the_trainers_weights_exactly(redraw_projections):
    model, optimizer = qwen2_and_optimizer(redraw_projections=redraw_projections)
    copy = weights(optimizer)
    for step in range(3):  # A is redrawn after every update (redraw_projections): each step has its own seeds
        projections = [state.projection.clone() for state in optimizer.sketches]
        batch = backward(model, optimizer, step)
        report = optimizer.step(logra_inputs=LoGRAStepInputs(ProbeBatch.from_token_batch(batch), record_low_rank=True))
        assert not report.skipped and report.alpha > 0
        updates = report.low_rank_updates
        assert [u.name for u in updates] == [f"{state.name}.weight" for state in optimizer.sketches]
        for update, projection in zip(updates, projections):
            assert torch.equal(update.projection(), projection)  # A re-derived from its seed alone
        for update, weight in zip(updates, copy):
            update.apply_to(weight)
        assert all(torch.equal(a, b) for a, b in zip(copy, weights(optimizer)))


def test_a_low_rank_update_costs_rank_over_width_of_a_full_one():
    model, optimizer = qwen2_and_optimizer()
    batch = backward(model, optimizer, 0)
    report = optimizer.step(logra_inputs=LoGRAStepInputs(ProbeBatch.from_token_batch(batch), record_low_rank=True))
    low_rank = sum(update.nbytes for update in report.low_rank_updates)
    full = sum(state.weight.numel() * state.weight.element_size() for state in optimizer.sketches)
    rows = sum(state.weight.shape[0] for state in optimizer.sketches)
    assert low_rank == rows * 8 * 4 + 8 * len(optimizer.sketches)  # rank 8, float32, one seed each
    assert low_rank < full / 3


def test_nothing_is_recorded_unless_asked():
    model, optimizer = qwen2_and_optimizer()
    batch = backward(model, optimizer, 0)
    report = optimizer.step(logra_inputs=LoGRAStepInputs(ProbeBatch.from_token_batch(batch)))
    assert report.low_rank_updates is None
