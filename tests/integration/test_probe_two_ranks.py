"""The KL probe on two gloo processes holding different numbers of sequences: every rank runs
the same forwards and gets the global mean."""

import pytest
import torch

from lightning_logra import ProbeBatch, probe_predicted_kl
from tests.helpers.core import prepared_probe_model, probe_sequences
from tests.helpers.distributed import run_on_two_ranks


def _probe_on_uneven_ranks(rank: int, world: int) -> tuple[float, int]:
    model, optimizer = prepared_probe_model("sdpa")
    input_ids, attention_mask, logits_mask = probe_sequences()
    rows = slice(0, 2) if rank == 0 else slice(2, 3)  # rank 0 has two sequences, rank 1 one
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    prediction = probe_predicted_kl(model, optimizer.probe_layers(), ProbeBatch(input_ids[rows], attention_mask[rows], logits_mask[rows]),
                                    process_group=torch.distributed.group.WORLD)
    return prediction, len(forwards)


@pytest.mark.distributed
def test_distributed_probe_runs_equal_forwards_and_returns_the_global_mean():
    model, optimizer = prepared_probe_model("sdpa")
    input_ids, attention_mask, logits_mask = probe_sequences()
    single = probe_predicted_kl(model, optimizer.probe_layers(), ProbeBatch(input_ids, attention_mask, logits_mask))
    (rank0, forwards0), (rank1, forwards1) = run_on_two_ranks(_probe_on_uneven_ranks)
    # Sharded models gather weights in every forward, so the rank with one sequence must
    # run a second (scoring nothing) to match the other.
    assert forwards0 == forwards1 == 2
    assert rank0 == rank1
    assert rank0 == pytest.approx(single, rel=1e-9)
