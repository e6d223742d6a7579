"""The packing check on two FSDP2 ranks: it runs on the sharded model, passes a model that
packs correctly (which then still trains), and refuses OPT on both ranks alike."""

import pytest
import torch

from lightning_logra.rl.collectives import any_rank
from lightning_logra.rl.packing import check_packing
from tests.helpers.architectures import tiny_opt
from tests.helpers.distributed import run_on_two_ranks
from tests.helpers.models import tiny_qwen2


def _check_rank(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    outcomes = []
    for model, layers in ((tiny_qwen2().train(), "model.layers"), (tiny_opt().train(), "model.decoder.layers")):
        for layer in model.get_submodule(layers):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        try:
            outcomes.append(check_packing(model, any_rank=lambda flag: any_rank(flag, torch.device("cpu"))))
        except ValueError as error:
            outcomes.append(str(error))
        model.reshard()
        model(torch.tensor([[1, 2, 3]])).logits.sum().backward()  # the sharded model still trains
    return outcomes


@pytest.mark.distributed
def test_the_packing_check_runs_on_fsdp2_shards_and_every_rank_refuses_alike():
    (qwen0, opt0), (qwen1, opt1) = run_on_two_ranks(_check_rank)
    assert qwen0 == qwen1 and qwen0 < 1e-5
    assert opt0.startswith("OPTForCausalLM: packed log-probs differ") and opt1.startswith("OPTForCausalLM")
