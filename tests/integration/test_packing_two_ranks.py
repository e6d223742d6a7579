"""Micro-batches by tokens on two FSDP2 ranks whose rollouts pack into different numbers of
micro-batches: both run the agreed number of backward passes (the extra ones change
nothing), and the gradients are those of all rows on one process."""

import pytest
import torch

from lightning_logra.rl.batch import backward_micro_batches
from lightning_logra.rl.metrics import PassTotals
from tests.helpers.distributed import run_on_two_ranks
from tests.helpers.models import tiny_qwen2
from tests.helpers.rollouts import micro_batching, rollout_batch

# Rank 0's rows pack into 4 micro-batches of <= 16 tokens, rank 1's into 2.
PROMPTS = [[3, 5, 2, 4], [4, 2, 3, 3]]
COMPLETIONS = [[9, 7, 10, 12], [2, 5, 1, 3]]
BUDGET = 16


def watched(model):
    """The gradients of a few weights, whole (gathered from FSDP2 shards)."""
    grads = [model.lm_head.weight.grad, model.model.layers[0].mlp.up_proj.weight.grad,
             model.model.layers[1].self_attn.q_proj.weight.grad]
    return [g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads]


def _packed_rank(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = tiny_qwen2().train()
    mesh = init_device_mesh("cpu", (world,))
    for module in [*model.model.layers, model.lm_head, model]:
        fully_shard(module, mesh=mesh)
    batch = rollout_batch(PROMPTS[rank], COMPLETIONS[rank], seed=rank)
    own = len(micro_batching(tokens=BUDGET).micro_batches(batch.rollouts.attention_mask, slice(0, 4)))
    backwards = []

    def backward(loss):
        backwards.append(float(loss))
        loss.backward()

    backward_micro_batches(model, batch, slice(0, 4), micro_batching(tokens=BUDGET), backward=backward,
                           passes=PassTotals.zeros(torch.device("cpu")), world=world)
    return own, backwards, watched(model)


def all_rows_on_one_process():
    """Both ranks' rows as one batch, padded, on one process (same advantages and log-probs)."""
    parts = [rollout_batch(PROMPTS[rank], COMPLETIONS[rank], seed=rank) for rank in range(2)]
    whole = rollout_batch(PROMPTS[0] + PROMPTS[1], COMPLETIONS[0] + COMPLETIONS[1])
    for rank, part in enumerate(parts):
        rows = slice(4 * rank, 4 * rank + 4)
        real = part.rollouts.attention_mask.bool()
        whole.rollouts.input_ids[rows][whole.rollouts.attention_mask[rows].bool()] = part.rollouts.input_ids[real]
        whole.rollout_logprobs[rows][whole.mask[rows]] = part.rollout_logprobs[part.mask]
        whole.advantages[rows] = part.advantages
    model = tiny_qwen2().train()
    backward_micro_batches(model, whole, slice(0, 8), micro_batching(size=2), backward=torch.Tensor.backward,
                           passes=PassTotals.zeros(torch.device("cpu")))
    return watched(model)


@pytest.mark.distributed
def test_ranks_agree_the_number_of_packed_micro_batches_and_average_exactly():
    (own0, backwards0, grads0), (own1, backwards1, grads1) = run_on_two_ranks(_packed_rank)
    assert (own0, own1) == (4, 2)
    assert len(backwards0) == len(backwards1) == 4
    assert backwards1[2:] == [0.0, 0.0]  # rank 1's two extra passes carry a zero loss
    for got0, got1, want in zip(grads0, grads1, all_rows_on_one_process()):
        torch.testing.assert_close(got0, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got1, want, rtol=1e-5, atol=1e-6)
