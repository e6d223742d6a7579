"""logra_fsdp on two processes, with the Trainer (all-reduced and reduce-scattered sketches)
and with Fabric: FSDP2 shards the policy, and the weights equal the plain-torch engine's."""

import warnings

import pytest
import torch

from lightning_logra import LoGRAFabricStrategy, LoGRAFSDPStrategy
from tests.helpers.distributed import run_lightning_on_two_ranks
from tests.helpers.lightning import CausalLM, config, fabric_loop, loader, reference_weights, trained_weights, trainer

# FSDP2's all-gathered weights compute exactly what the plain weights compute; with two
# ranks the sketch is a mean of two half-batch sketches: float32 round-off.
TWO_RANK_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


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
    weights = fabric_loop(fabric, rank, world)
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
