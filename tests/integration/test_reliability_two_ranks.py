"""Faults on two processes: a NaN on one rank is skipped on both, and ranks that derived
different projections or configurations are stopped."""

import pytest
import torch

from lightning_logra import LoGRAOptimizer
from lightning_logra.core.reliability import verify_ranks_agree
from tests.helpers.distributed import run_lightning_on_two_ranks, run_on_two_ranks
from tests.helpers.lightning import PoisonedLoss, config, fit_recording_warnings
from tests.helpers.models import tiny_qwen2


def _poison_one_rank(rank, world):
    module = PoisonedLoss(poisoned_steps=[1], rank=1)
    strategy, _ = fit_recording_warnings(module, config(), steps=3, devices=2, rank=rank, world=world)
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
