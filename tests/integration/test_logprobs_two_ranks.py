"""sequence_logprobs on a Qwen2 sharded by FSDP2 over two processes: the unsharded model's
log-probs and gradients."""

import pytest
import torch

from lightning_logra.rl.logprobs import sequence_logprobs
from tests.helpers.distributed import run_on_two_ranks
from tests.helpers.models import left_padded_batch, tiny_qwen2


def _fsdp2_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    input_ids, attention_mask = left_padded_batch()
    reference, sharded = tiny_qwen2(), tiny_qwen2()
    mesh = init_device_mesh("cpu", (world,))
    for module in [*sharded.model.layers, sharded.lm_head, sharded]:
        fully_shard(module, mesh=mesh)
    results = []
    for model in (reference, sharded):
        lp = sequence_logprobs(model, input_ids, attention_mask, chunk_size=4)
        lp[:, 2:].sum().backward()
        grads = [model.lm_head.weight.grad, model.model.layers[0].mlp.up_proj.weight.grad]
        results.append((lp.detach(), [g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads]))
    return results


@pytest.mark.distributed
def test_sequence_logprobs_under_fsdp2_matches_the_unsharded_model():
    for (ref_lp, ref_grads), (lp, grads) in run_on_two_ranks(_fsdp2_worker):
        torch.testing.assert_close(lp, ref_lp)
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, want)
