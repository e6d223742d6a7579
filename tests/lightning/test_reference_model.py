"""The KL reference model under logra_fsdp: kept in the compute dtype, frozen, and scoring as
an unsharded float32 copy does (on two processes: tests/integration/test_reference_model_two_ranks.py)."""

import torch

from tests.helpers.grpo import BF16_ATOL, fit_with_reference, reference_and_plain_logprobs


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
