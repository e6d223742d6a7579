"""Micro-batches by tokens: packed rows compute exactly what padded rows do, and no padding."""

import warnings

import pytest
import torch

from lightning_logra.core.config import LoGRAConfig
from lightning_logra.core.optimizer import LoGRAOptimizer
from lightning_logra.core.step_inputs import LoGRAStepInputs
from lightning_logra.models import enable_activation_checkpointing, with_lora
from lightning_logra.rl.batch import backward_micro_batches, batch_logprobs
from lightning_logra.rl.config import LoRAConfig, LossConfig
from lightning_logra.rl.logprobs import packed_sequence_logprobs, sequence_logprobs
from lightning_logra.rl.metrics import PassTotals
from lightning_logra.rl.packing import first_fit_decreasing, token_micro_batches
from tests.helpers.models import tiny_qwen2
from tests.helpers.rollouts import micro_batching, rollout_batch

PROMPTS = [3, 5, 2, 4, 6, 3]
COMPLETIONS = [1, 7, 3, 12, 2, 5]
BUDGET = 16  # real tokens per packed micro-batch: the 6 rows (53 tokens) pack into 4


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_first_fit_decreasing_fills_each_group_up_to_the_budget():
    groups = first_fit_decreasing([5, 9, 3, 7, 2, 4], budget=10)
    # Longest first: 9 | 7 | 5 | 4 joins 5 | 3 joins 7 | 2 fits nowhere (30 tokens need 4 groups anyway).
    assert groups == [[1], [2, 3], [0, 5], [4]]
    lengths = [5, 9, 3, 7, 2, 4]
    assert all(sum(lengths[i] for i in group) <= 10 for group in groups)
    assert sorted(i for group in groups for i in group) == list(range(6))


def test_a_sequence_over_the_budget_runs_alone_with_one_warning_naming_the_budget():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        groups = first_fit_decreasing([12, 3, 15, 4], budget=10)
    assert groups == [[2], [0], [1, 3]]
    assert len(caught) == 1 and "micro_batch_tokens = 10" in str(caught[0].message)


def test_token_micro_batches_index_the_rows_of_the_slice():
    batch = rollout_batch(PROMPTS, COMPLETIONS)
    parts = token_micro_batches(batch.rollouts.attention_mask, slice(2, 6), budget=BUDGET)
    lengths = batch.rollouts.attention_mask.sum(1)
    assert sorted(int(r) for part in parts for r in part) == [2, 3, 4, 5]
    assert all(int(lengths[part].sum()) <= BUDGET for part in parts)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_logprobs_and_entropies_equal_the_padded_ones(attention):
    model = tiny_qwen2()
    model.config._attn_implementation = attention
    batch = rollout_batch(PROMPTS, COMPLETIONS)
    ids, attention_mask = batch.rollouts.input_ids, batch.rollouts.attention_mask
    scored = attention_mask[:, 1:].bool() & attention_mask[:, :-1].bool()
    padded, padded_entropy = sequence_logprobs(model, ids, attention_mask, temperature=0.9, return_entropy=True)
    packed, packed_entropy = packed_sequence_logprobs(model, ids, attention_mask, temperature=0.9, chunk_size=5,
                                                      return_entropy=True)
    close(packed[scored], padded[scored])
    close(packed_entropy[scored], padded_entropy[scored])
    assert (packed[~scored] == 0).all()


def test_packed_logprobs_refuse_a_row_with_padding_between_real_tokens():
    ids = torch.ones(2, 5, dtype=torch.long)
    attention_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 1, 1]])
    with pytest.raises(ValueError, match="attention_mask row 1 has padding between real tokens"):
        packed_sequence_logprobs(tiny_qwen2(), ids, attention_mask)


def embedded_tokens(model) -> list[int]:
    """The number of token positions each forward of ``model`` computes."""
    counts = []
    model.get_input_embeddings().register_forward_pre_hook(lambda module, args: counts.append(args[0].numel()))
    return counts


def gradients_of(model, batch, settings) -> tuple[dict[str, torch.Tensor], torch.Tensor, list[int]]:
    """Gradients of every trainable weight after one update's micro-batched backward, the
    trainer log-probs it returns, and the tokens each forward computed."""
    counts = embedded_tokens(model)
    trained = backward_micro_batches(model, batch, slice(0, len(PROMPTS)), settings, backward=torch.Tensor.backward,
                                     passes=PassTotals.zeros(torch.device("cpu")))
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    return grads, trained, counts


def compare_padded_and_packed(build, batch, loss=None):
    padded_grads, padded, padded_counts = gradients_of(build(), batch, micro_batching(loss, size=2))
    packed_grads, packed, packed_counts = gradients_of(build(), batch, micro_batching(loss, tokens=BUDGET))
    assert padded_grads.keys() == packed_grads.keys() and padded_grads
    for name in padded_grads:
        close(packed_grads[name], padded_grads[name])
    close(packed[batch.mask], padded[batch.mask])
    real = int(batch.rollouts.attention_mask.sum())
    assert sum(packed_counts) == real < sum(padded_counts)
    return packed_counts


LOSSES = [LossConfig(), LossConfig(aggregation="sequence"), LossConfig(type="dr_grpo"), LossConfig(type="gspo"),
          LossConfig(type="reinforce_baseline")]


@pytest.mark.parametrize("loss", LOSSES, ids=["grpo_token", "grpo_sequence", "dr_grpo", "gspo", "reinforce"])
def test_packed_dense_gradients_equal_the_padded_ones_for_every_loss(loss):
    counts = compare_padded_and_packed(lambda: tiny_qwen2().train(), rollout_batch(PROMPTS, COMPLETIONS), loss)
    assert counts == [16, 16, 16, 5]


def test_packed_gradients_equal_the_padded_ones_with_masked_rows_and_a_reference():
    # Truncated rows carry no loss (mask_truncated); the KL term reads reference log-probs
    # computed packed and padded in turn.
    batch = rollout_batch(PROMPTS, COMPLETIONS, ended_with_eos=[True, False, True, True, False, True],
                          mask_truncated=True)
    reference = tiny_qwen2(seed=1)
    with torch.no_grad():
        padded_reference = batch_logprobs(reference, batch.rollouts.input_ids, batch.rollouts.attention_mask,
                                          micro_batching(size=4))
        batch.reference_logprobs = batch_logprobs(reference, batch.rollouts.input_ids, batch.rollouts.attention_mask,
                                                  micro_batching(tokens=BUDGET))
    close(batch.reference_logprobs[batch.mask], padded_reference[batch.mask])
    for loss in (LossConfig(kl_coef=0.1), LossConfig(aggregation="sequence", kl_coef=0.1)):
        compare_padded_and_packed(lambda: tiny_qwen2().train(), batch, loss)


def test_sequence_means_weight_micro_batches_by_their_rows_with_tokens():
    # Rows 0 and 1 share the first micro-batch of 2 and row 1 has no loss-bearing token: the
    # update is still the mean over the rows that have tokens, as in one micro-batch of all.
    batch = rollout_batch(PROMPTS, COMPLETIONS, ended_with_eos=[True, False, True, True, True, True],
                          mask_truncated=True)
    for loss in (LossConfig(aggregation="sequence"), LossConfig(type="gspo")):
        whole, _, _ = gradients_of(tiny_qwen2().train(), batch, micro_batching(loss, size=len(PROMPTS)))
        pairs, _, _ = gradients_of(tiny_qwen2().train(), batch, micro_batching(loss, size=2))
        for name in whole:
            close(pairs[name], whole[name])


def test_packed_gradients_equal_the_padded_ones_under_activation_checkpointing():
    def build():
        model = tiny_qwen2().train()
        enable_activation_checkpointing(model)
        return model

    compare_padded_and_packed(build, rollout_batch(PROMPTS, COMPLETIONS))


def test_packed_lora_gradients_equal_the_padded_ones():
    def build():
        return with_lora(tiny_qwen2().train(), LoRAConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"]))

    grads = compare_padded_and_packed(build, rollout_batch(PROMPTS, COMPLETIONS))
    assert grads


def logra_step(batch, settings, packed_probe: bool):
    model = tiny_qwen2().train()
    # A float32 update factor: the default rounds alpha * D to bfloat16, where an alpha that
    # differs in its 8th digit (summation order) can land an entry on the other side of a
    # rounding boundary, one bfloat16 ulp (2^-8 relative) apart: measured 2.7e-6 on a
    # 1.3e-3 entry. In float32 the updates agree to 4e-9.
    optimizer = LoGRAOptimizer(model, LoGRAConfig(rank=8, update_ratio=1e-2, kl_budget=1e-4, probe_responses=4,
                                                  update_factor_dtype="float32"))
    backward_micro_batches(model, batch, slice(0, len(PROMPTS)), settings, backward=torch.Tensor.backward,
                           passes=PassTotals.zeros(torch.device("cpu")))
    sketches = optimizer.sketches.buffer.clone()
    probe = batch.probe_batch(slice(0, len(PROMPTS)), num_generations=2, temperature=0.9, packed=packed_probe)
    report = optimizer.step(logra_inputs=LoGRAStepInputs(probe=probe))
    return sketches, report, [p.detach().clone() for p in model.parameters()]


def test_packed_logra_sketches_probe_and_update_equal_the_padded_ones():
    batch = rollout_batch(PROMPTS, COMPLETIONS)
    padded_sketches, padded_report, padded_weights = logra_step(batch, micro_batching(size=2), packed_probe=False)
    packed_sketches, packed_report, packed_weights = logra_step(batch, micro_batching(tokens=BUDGET), packed_probe=True)
    assert padded_sketches.abs().sum() > 0
    close(packed_sketches, padded_sketches)
    assert packed_report.predicted_kl == pytest.approx(padded_report.predicted_kl, rel=1e-5)
    assert packed_report.alpha == pytest.approx(padded_report.alpha, rel=1e-5)
    for packed, padded in zip(packed_weights, padded_weights):
        close(packed, padded)


def test_the_packed_probe_computes_real_tokens_only():
    batch = rollout_batch(PROMPTS, COMPLETIONS)
    probe = batch.probe_batch(slice(0, len(PROMPTS)), num_generations=2, temperature=0.9, packed=True)
    groups = probe.packed_groups(max_tokens=None)
    inputs, scored = probe.packed_inputs(groups[0], max_tokens=None)
    real = probe.attention_mask[groups[0]].sum()
    assert "attention_mask" not in inputs and inputs["input_ids"].shape == (1, real) == scored.shape
    assert inputs["position_ids"][0, 0] == 0
