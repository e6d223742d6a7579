"""The KL reference model under logra_fsdp: kept in the compute dtype, FSDP2-sharded like the
policy across ranks, frozen, and scoring as an unsharded float32 copy does."""

import warnings

import lightning as L
import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from lightning_logra import LoGRAConfig, LoGRAFSDPStrategy
from lightning_logra.models import load_policy
from lightning_logra.modules import LossConfig
from lightning_logra.rl.logprobs import sequence_logprobs
from tests.distributed import run_lightning_on_two_ranks
from tests.lightning_helpers import record_step_inputs
from tests.lightning.test_grpo_module import data, module

BF16_ATOL = 0.02  # bf16 rounds at 2^-8 relative; log-probs here are ~5.6 in size; measured max 1.4e-3


def fit_with_reference(folder, precision, devices=1):
    grpo = module(folder, loss=LossConfig(kl_coef=0.1), rewards=["tests.lightning.test_grpo_features:varied_reward"])
    strategy = LoGRAFSDPStrategy(logra=LoGRAConfig(rank=8, update_ratio=1e-3))
    grpo.probes = record_step_inputs(grpo)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=1, logger=False, precision=precision,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  limit_val_batches=0).fit(grpo, data(folder))
    return grpo


def reference_and_plain_logprobs(grpo, folder):
    """The trained module's reference vs a fresh unsharded float32 copy, on the last rollouts."""
    batch = grpo.probes[-1].probe
    plain, _ = load_policy(folder)
    with torch.no_grad():
        kept = sequence_logprobs(grpo.reference, batch.input_ids, batch.attention_mask)
        fresh = sequence_logprobs(plain.eval(), batch.input_ids, batch.attention_mask)
    mask = batch.logits_mask[:, :-1]
    return kept[mask], fresh[mask]


def test_reference_is_kept_in_bf16_under_bf16_mixed(model_folder):
    grpo = fit_with_reference(model_folder, "bf16-mixed")
    assert {p.dtype for p in grpo.reference.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in grpo.policy.parameters()} == {torch.float32}  # master weights stay float32
    assert not any(p.requires_grad for p in grpo.reference.parameters())
    kept, fresh = reference_and_plain_logprobs(grpo, model_folder)
    torch.testing.assert_close(kept, fresh, rtol=0, atol=BF16_ATOL)


def test_reference_stays_float32_under_32_true(model_folder):
    grpo = fit_with_reference(model_folder, "32-true")
    assert {p.dtype for p in grpo.reference.parameters()} == {torch.float32}


def _two_rank_reference(rank, world, folder, precision):
    grpo = fit_with_reference(folder, precision, devices=2)
    blocks = [grpo.reference, *grpo.reference.model.layers]
    sharded = all(isinstance(block, FSDPModule) for block in blocks) and all(
        hasattr(p, "full_tensor") for p in grpo.reference.parameters())  # resharded after its forward
    dtypes = {p.dtype for p in grpo.reference.parameters()}
    kept, fresh = reference_and_plain_logprobs(grpo, folder)
    return sharded, dtypes, kept, fresh


@pytest.mark.distributed
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_two_processes_shard_the_reference_and_score_as_an_unsharded_copy(model_folder, precision):
    for sharded, dtypes, kept, fresh in run_lightning_on_two_ranks(_two_rank_reference, model_folder, precision):
        assert sharded  # the reference and its blocks are FSDP2 modules; every parameter a shard
        if precision == "32-true":
            assert dtypes == {torch.float32}
            assert torch.equal(kept, fresh)  # gathered float32 shards compute what the whole copy does
        else:
            assert dtypes == {torch.bfloat16}
            torch.testing.assert_close(kept, fresh, rtol=0, atol=BF16_ATOL)
