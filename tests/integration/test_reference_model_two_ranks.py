"""The KL reference model on two processes: FSDP2-sharded like the policy, in the compute
dtype, scoring as an unsharded float32 copy does."""

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from tests.helpers.distributed import run_lightning_on_two_ranks
from tests.helpers.grpo import BF16_ATOL, fit_with_reference, reference_and_plain_logprobs


def _two_rank_reference(rank, world, folder, precision):
    grpo = fit_with_reference(folder, precision, devices=2)
    blocks = [grpo.reference, *grpo.reference.model.layers]
    sharded = all(isinstance(block, FSDPModule) for block in blocks) and all(
        hasattr(p, "full_tensor") for p in grpo.reference.parameters())  # resharded after its forward
    dtypes = {p.dtype for p in grpo.reference.parameters()}
    kept, fresh = reference_and_plain_logprobs(grpo, folder)
    return sharded, dtypes, kept, fresh


@pytest.mark.distributed
# bf16-mixed (30 s) is slow; 32-true stays in the default run.
@pytest.mark.parametrize("precision", ["32-true", pytest.param("bf16-mixed", marks=pytest.mark.slow)])
def test_two_processes_shard_the_reference_and_score_as_an_unsharded_copy(model_folder, precision):
    for sharded, dtypes, kept, fresh in run_lightning_on_two_ranks(_two_rank_reference, model_folder, precision):
        assert sharded  # the reference and its blocks are FSDP2 modules; every parameter a shard
        if precision == "32-true":
            assert dtypes == {torch.float32}
            assert torch.equal(kept, fresh)  # gathered float32 shards compute what the whole copy does
        else:
            assert dtypes == {torch.bfloat16}
            torch.testing.assert_close(kept, fresh, rtol=0, atol=BF16_ATOL)
