import math

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch import nn

from lightning_logra import LoGRAConfig, ProbeBatch, kl_step_scale, predicted_kl, probe_predicted_kl, scheduled_budget
from lightning_logra.core.kl import KLController, effective_budget, measured_kl, mismatch_sums, observed_mismatch, update_mismatch
from tests.helpers.core import prepared_probe_model, probe_sequences


def test_predicted_kl_matches_the_exact_kl_of_a_small_logit_step():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=generator, dtype=torch.float64) * 3
    tangent = torch.randn(6, 50, generator=generator, dtype=torch.float64)
    for temperature in (1.0, 0.7):
        step = 1e-3
        exact = measured_kl(logits, logits + step * tangent, temperature=temperature)
        predicted = step**2 * predicted_kl(logits, tangent, temperature=temperature)
        assert math.isclose(predicted.item(), exact.item(), rel_tol=1e-3)


def test_predicted_kl_is_a_float64_masked_mean():
    logits = torch.zeros(2, 3, 4)
    tangent = torch.zeros(2, 3, 4)
    tangent[0, 0, 0] = 2.0  # p uniform: 0.5 * E[(u - E u)^2] = 0.5 * (4/4 - (2/4)^2) = 0.375
    mask = torch.tensor([[1, 0, 0], [0, 0, 1]])
    value = predicted_kl(logits, tangent, mask=mask)
    assert value.dtype == torch.float64 and value.item() == pytest.approx(0.375 / 2)
    assert predicted_kl(logits, tangent, mask=torch.zeros(2, 3)).item() == 0.0


def test_float32_fisher_form_is_within_float32_round_off_of_float64():
    # Realistic sizes: a vocabulary of 32k, peaked logits, and tangents with a common
    # offset (a shift of every logit moves no probability; centring must cancel it).
    from lightning_logra.core.kl import kl_per_position

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 32000, generator=generator) * 4
    tangent = torch.randn(64, 32000, generator=generator) * 0.01 + 0.3
    float32 = kl_per_position(logits, tangent, temperature=0.7)
    float64 = kl_per_position(logits.double(), tangent.double(), temperature=0.7)
    assert float32.dtype == torch.float32 and float64.dtype == torch.float64
    # float32 sums over 32k terms: measured max 3e-6 relative per position; 2e-5 bounds it.
    torch.testing.assert_close(float32.double(), float64, rtol=2e-5, atol=0)


def test_step_scale_is_the_root_of_budget_over_predicted_kl_capped_at_alpha_max():
    assert kl_step_scale(4e-4, budget=1e-4, alpha_max=3.0) == pytest.approx(0.5)
    assert kl_step_scale(1e-12, budget=1e-4, alpha_max=3.0) == 3.0
    assert kl_step_scale(0.0, budget=1e-4) == 1.0
    for bad in (float("nan"), -1e-9, float("inf")):
        with pytest.raises(FloatingPointError):
            kl_step_scale(bad, budget=1e-4)


def test_budget_schedule_is_a_cosine_from_start_to_final():
    config = LoGRAConfig()
    assert scheduled_budget(config, 0) == pytest.approx(2e-4)
    assert scheduled_budget(config, 299) == pytest.approx(2e-5)
    assert scheduled_budget(config, 5000) == pytest.approx(2e-5)
    middle = 2e-5 + 0.5 * 1.8e-4 * (1 + math.cos(math.pi * 100 / 299))
    assert scheduled_budget(config, 100) == pytest.approx(middle, rel=1e-12)


def test_mismatch_ema_and_budget_floor():
    rollout = torch.tensor([[-1.0, -2.0, 0.0]])
    trainer = torch.tensor([[-1.5, -2.1, -9.0]])
    mask = torch.tensor([[1, 1, 0]])
    assert observed_mismatch(rollout, trainer, mask) == pytest.approx(0.3)
    assert observed_mismatch(trainer, rollout, mask) == 0.0  # clipped at 0
    assert update_mismatch(0.1, 0.3, ema_weight=0.3) == pytest.approx(0.7 * 0.1 + 0.3 * 0.3)
    assert effective_budget(2e-4, 5e-5, floor=0.5) == pytest.approx(1.5e-4)
    assert effective_budget(2e-4, 5e-4, floor=0.5) == pytest.approx(1e-4)


def test_a_non_finite_log_prob_pair_is_left_out_of_the_mismatch_and_counted():
    rollout = torch.tensor([[-1.0, -2.0, -0.5, 0.0]])
    trainer = torch.tensor([[-1.5, -2.1, -math.inf, -9.0]])  # a token the trainer gives probability 0
    mask = torch.tensor([[1, 1, 1, 0]])
    assert mismatch_sums(rollout, trainer, mask).tolist() == pytest.approx([0.6, 2.0, 1.0])
    assert observed_mismatch(rollout, trainer, mask) == pytest.approx(0.3)  # the two finite pairs
    controller = KLController(LoGRAConfig(kl_budget=2e-4, kl_budget_final=2e-4))
    for _ in range(3):  # the EMA stays finite step after step
        budget = controller.budget(0, mismatch_sums(rollout, trainer, mask))
        controller.commit(budget)
        assert math.isfinite(controller.mismatch) and budget.nonfinite_pairs == 1
    nan_only = controller.budget(0, mismatch_sums(torch.tensor([[math.nan]]), torch.tensor([[-1.0]]), torch.tensor([[1]])))
    assert nan_only.mismatch == controller.mismatch and nan_only.nonfinite_pairs == 1  # nothing finite: EMA unchanged


@torch.no_grad()
def logits_of(model, input_ids, attention_mask):
    model.eval()
    return model(input_ids=input_ids, attention_mask=attention_mask).logits


def test_jvp_probe_predicts_the_measured_kl_of_the_applied_update():
    model, optimizer = prepared_probe_model()
    input_ids, attention_mask, logits_mask = probe_sequences()
    prediction = probe_predicted_kl(model, optimizer.probe_layers(), ProbeBatch(input_ids, attention_mask, logits_mask), position_chunk=5)
    alpha = kl_step_scale(prediction, budget=1e-4, alpha_max=3.0)
    before = logits_of(model, input_ids, attention_mask)
    optimizer.apply_update(alpha=alpha)
    after = logits_of(model, input_ids, attention_mask)
    measured = measured_kl(before, after, mask=logits_mask).item()
    assert measured > 0
    assert alpha**2 * prediction == pytest.approx(measured, rel=0.05)


def test_probe_under_bf16_autocast_matches_the_float32_probe():
    # bf16-mixed training (GRPOModule steps inside its training step, under autocast):
    # float32 residual inputs, bfloat16 layer outputs and tangents.
    model, optimizer = prepared_probe_model()
    input_ids, attention_mask, logits_mask = probe_sequences()
    reference = probe_predicted_kl(model, optimizer.probe_layers(), ProbeBatch(input_ids, attention_mask, logits_mask))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = probe_predicted_kl(model, optimizer.probe_layers(), ProbeBatch(input_ids, attention_mask, logits_mask))
    # bfloat16 rounds each operation to 2^-9 (0.2%) relative; the errors of a 2-layer model
    # partly cancel in the mean over positions (measured: 0.07%), so 1% is a loose bound.
    assert mixed == pytest.approx(reference, rel=0.01)
    assert reference > 0


def test_mlps_in_token_chunks_give_the_whole_row_prediction_and_are_restored():
    from lightning_logra.core.probe_modules import position_wise_mlps

    model, optimizer = prepared_probe_model()
    input_ids, attention_mask, logits_mask = probe_sequences()
    batch = ProbeBatch(input_ids, attention_mask, logits_mask)
    whole = probe_predicted_kl(model, optimizer.probe_layers(), batch, mlp_chunk=input_ids.shape[1])
    calls = []
    mlps = position_wise_mlps(model)
    handles = [mlp.down_proj.register_forward_hook(lambda module, args, output: calls.append(args[0].shape[-2])) for mlp in mlps]
    chunked = probe_predicted_kl(model, optimizer.probe_layers(), batch, mlp_chunk=3)
    for handle in handles:
        handle.remove()
    assert len(mlps) == 2 and set(calls) <= {1, 2, 3} and max(calls) == 3  # every MLP saw 3 tokens at a time at most
    # Each token's MLP output depends on that token alone; the matmuls only change row blocks.
    assert chunked == pytest.approx(whole, rel=1e-6)
    assert all("forward" not in mlp.__dict__ for mlp in mlps)  # the class's forward again


def test_chunked_head_path_equals_full_logits_path():
    model, optimizer = prepared_probe_model()
    input_ids, attention_mask, logits_mask = probe_sequences()
    chunked = probe_predicted_kl(model, optimizer.probe_layers(), ProbeBatch(input_ids, attention_mask, logits_mask), position_chunk=4)

    class WithoutHeadAccess(nn.Module):  # forces the full-logits path
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, **kwargs):
            return self.inner(**kwargs).logits

    full = probe_predicted_kl(WithoutHeadAccess(model), optimizer.probe_layers(), ProbeBatch(input_ids, attention_mask, logits_mask))
    assert chunked == pytest.approx(full, rel=1e-6)
    assert chunked > 0


def test_probe_works_with_sdpa_and_restores_modes_and_attention():
    model, optimizer = prepared_probe_model("eager")
    input_ids, attention_mask, logits_mask = probe_sequences()
    eager = probe_predicted_kl(model, optimizer.probe_layers(), ProbeBatch(input_ids, attention_mask, logits_mask))
    model.set_attn_implementation("sdpa")
    model.train()
    model.model.layers[0].eval()  # a mixed state must come back exactly
    sdpa = probe_predicted_kl(model, optimizer.probe_layers(), ProbeBatch(input_ids, attention_mask, logits_mask))
    assert sdpa == pytest.approx(eager, rel=1e-5)
    assert model.training and not model.model.layers[0].training and model.model.layers[1].training
    assert model.config._attn_implementation == "sdpa"


def test_probe_restores_training_mode_on_error():
    model, optimizer = prepared_probe_model()
    model.train()
    input_ids, attention_mask, logits_mask = probe_sequences()
    with pytest.raises(IndexError):
        probe_predicted_kl(model, optimizer.probe_layers(), ProbeBatch(input_ids + 1000, attention_mask, logits_mask))
    assert all(module.training for module in model.modules())
    assert all(not module._forward_hooks or len(module._forward_hooks) == 1 for module in model.modules())


def test_probe_does_not_modify_weights_or_sketch_anything():
    model, optimizer = prepared_probe_model()
    input_ids, attention_mask, logits_mask = probe_sequences()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    probe_predicted_kl(model, optimizer.probe_layers(), ProbeBatch(input_ids, attention_mask, logits_mask))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(state.backward_calls == 1 for state in optimizer.sketches)


@pytest.mark.parametrize("case", ["causal", "bool_mask", "float_mask", "gqa"])
def test_blocked_probe_attention_equals_sdpa_in_value_and_tangent(case):
    from lightning_logra.core.probe_modules import _ProbeFunctions

    generator = torch.Generator().manual_seed(3)
    query, key, value, q_tangent, v_tangent = (torch.randn(2, 4, 11, 8, generator=generator, dtype=torch.float64) for _ in range(5))
    kwargs = {}
    if case == "causal":
        kwargs["is_causal"] = True
    if case in ("bool_mask", "float_mask"):
        allowed = torch.ones(11, 11, dtype=torch.bool).tril().expand(2, 1, 11, 11).clone()
        allowed[1, :, :, :3] = False  # left padding of the second row
        allowed[1, :, :3, 0] = True  # padding queries see one key, as HF masks do
        kwargs["attn_mask"] = allowed if case == "bool_mask" else torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, -1e9)
    if case == "gqa":
        key, value, v_tangent = key[:, :2], value[:, :2], v_tangent[:, :2]
        kwargs["enable_gqa"] = True

    def run(mode):
        with fwAD.dual_level(), mode:
            out = nn.functional.scaled_dot_product_attention(
                fwAD.make_dual(query, q_tangent), key, fwAD.make_dual(value, v_tangent), **kwargs
            )
            primal, tangent = fwAD.unpack_dual(out)
            return primal.clone(), tangent.clone()

    from torch.nn.attention import SDPBackend, sdpa_kernel

    expected = run(sdpa_kernel([SDPBackend.MATH]))
    actual = run(_ProbeFunctions(block=4))
    # float64 throughout: only summation order differs.
    torch.testing.assert_close(actual[0], expected[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(actual[1], expected[1], rtol=1e-12, atol=1e-12)


def test_blocked_probe_attention_gives_zero_for_a_query_that_sees_nothing():
    from lightning_logra.core.probe_modules import _ProbeFunctions

    query = key = value = torch.randn(1, 1, 3, 4)
    allowed = torch.ones(1, 1, 3, 3, dtype=torch.bool).tril()
    allowed[..., 0, :] = False
    with _ProbeFunctions(block=2):
        out = nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=allowed)
    assert torch.equal(out[0, 0, 0], torch.zeros(4))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("bf16_autocast", [False, True])
def test_probe_linear_gives_forward_ads_value_and_tangent_from_two_gemms(bias, bf16_autocast):
    """Forward AD's own rule for F.linear also multiplies the input by the weight's zero
    tangent (a third GEMM); the probe's rule skips it and keeps every bit."""
    from contextlib import nullcontext

    from torch.profiler import profile

    from lightning_logra.core.probe_modules import _ProbeFunctions

    generator = torch.Generator().manual_seed(5)
    linear = nn.Linear(16, 24, bias=bias)
    inputs, tangent = (torch.randn(2, 7, 16, generator=generator) for _ in range(2))

    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16_autocast else nullcontext()

    def run(mode):
        with torch.no_grad(), fwAD.dual_level(), autocast, mode, profile() as profiler:
            primal, out_tangent = fwAD.unpack_dual(linear(fwAD.make_dual(inputs, tangent)))
            result = primal.clone(), out_tangent.clone()
        gemms = sum(event.count for event in profiler.key_averages() if event.key in ("aten::mm", "aten::addmm"))
        return result, gemms

    (expected, forward_ad_gemms), (actual, probe_gemms) = run(nullcontext()), run(_ProbeFunctions(block=4))
    assert torch.equal(actual[0], expected[0]) and torch.equal(actual[1], expected[1])
    assert (forward_ad_gemms, probe_gemms) == (3, 2)


def test_probe_one_sequence_at_a_time_matches_the_mean_over_the_batch():
    model, optimizer = prepared_probe_model("sdpa")
    input_ids, attention_mask, logits_mask = probe_sequences()
    whole = probe_predicted_kl(model, optimizer.probe_layers(), ProbeBatch(input_ids, attention_mask, logits_mask))
    per_row = [
        probe_predicted_kl(model, optimizer.probe_layers(), ProbeBatch(input_ids[i : i + 1], attention_mask[i : i + 1], logits_mask[i : i + 1]))
        for i in range(3)
    ]
    counts = logits_mask.sum(dim=1).tolist()
    assert whole == pytest.approx(sum(p * c for p, c in zip(per_row, counts)) / sum(counts), rel=1e-12)


def test_probe_packs_short_rows_into_one_forward_with_the_per_row_result():
    model, optimizer = prepared_probe_model("sdpa")
    input_ids, attention_mask, logits_mask = probe_sequences()  # rows of 12, 12 and 9 real tokens
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    packed = probe_predicted_kl(model, optimizer.probe_layers(), ProbeBatch(input_ids, attention_mask, logits_mask), max_tokens=36)
    assert len(forwards) == 1  # 3 rows x 12 padded tokens fit the 36-token budget
    per_row = [
        probe_predicted_kl(model, optimizer.probe_layers(), ProbeBatch(input_ids[i : i + 1], attention_mask[i : i + 1], logits_mask[i : i + 1]))
        for i in range(3)
    ]
    counts = logits_mask.sum(dim=1).tolist()
    # Same positions, same float32 model; only the batched matmuls' summation order differs.
    assert packed == pytest.approx(sum(p * c for p, c in zip(per_row, counts)) / sum(counts), rel=1e-5)
    assert ProbeBatch(input_ids, attention_mask, logits_mask).packed_groups(24) == [[0, 1], [2]]


def test_probe_max_tokens_counts_real_tokens_not_left_padding():
    input_ids, attention_mask, logits_mask = probe_sequences()  # row 2 has 3 left-padding tokens
    batch = ProbeBatch(input_ids, attention_mask, logits_mask)
    inputs, scored = batch.row_inputs(2, max_tokens=6)
    assert torch.equal(inputs["input_ids"], input_ids[2:3, 3:9]) and bool(inputs["attention_mask"].all())
    assert torch.equal(scored, logits_mask[2:3, 3:9])
    model, optimizer = prepared_probe_model("sdpa")
    padded = probe_predicted_kl(model, optimizer.probe_layers(), batch.first_rows(3), max_tokens=6)
    unpadded = [ProbeBatch(input_ids[i : i + 1, s : s + 6], attention_mask[i : i + 1, s : s + 6], logits_mask[i : i + 1, s : s + 6])
                for i, s in ((0, 0), (1, 0), (2, 3))]
    per_row = [probe_predicted_kl(model, optimizer.probe_layers(), row) for row in unpadded]
    counts = [int(row.logits_mask.sum()) for row in unpadded]
    assert padded == pytest.approx(sum(p * c for p, c in zip(per_row, counts)) / sum(counts), rel=1e-12)
