"""One LoGRA step in one call: LoGRAOptimizer.step -> StepReport, without Lightning."""

import dataclasses
import io
import math

import pytest
import torch

from lightning_logra import LoGRAStepInputs, ProbeBatch, probe_predicted_kl, scheduled_budget
from lightning_logra.core import validation
from lightning_logra.core.probe import EmptyProbeError
from tests.helpers.core import KeywordCalledLinear, backward, qwen2_and_optimizer, weights


def eos_pairs(observed_gap: float, eos: bool):
    trainer_logprobs = torch.full((2, 3), -1.0)
    mask = torch.ones(2, 3) if eos else torch.zeros(2, 3)
    return trainer_logprobs + observed_gap, trainer_logprobs, mask


def test_the_inputs_fields_as_keywords_warn_once_and_step_the_same():
    """The keywords of earlier versions (``step(probe=...)``) are deprecated aliases of
    ``logra_inputs``: the same update, bit for bit, and one FutureWarning naming the new form."""
    new_model, new = qwen2_and_optimizer()
    batch = backward(new_model, new, 0)
    expected = new.step(logra_inputs=LoGRAStepInputs(ProbeBatch.from_token_batch(batch), eos_pairs(0.3, eos=True)))
    old_model, old = qwen2_and_optimizer()
    backward(old_model, old, 0)
    validation._warned_aliases.discard("LoGRAOptimizer.step(probe=...)")
    with pytest.warns(FutureWarning, match=r"LoGRAOptimizer.step\(probe=...\) is deprecated: use "
                                           r"step\(logra_inputs=LoGRAStepInputs\(probe=...\)\)"):
        report = old.step(probe=ProbeBatch.from_token_batch(batch), logprob_pairs=eos_pairs(0.3, eos=True))
    assert report.alpha == expected.alpha and report.mismatch == expected.mismatch
    assert all(torch.equal(a, b) for a, b in zip(weights(old), weights(new)))
    with pytest.raises(TypeError, match="not both"):
        old.step(logra_inputs=LoGRAStepInputs(), probe=ProbeBatch.from_token_batch(batch))
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['prob'\]"):
        old.step(prob=ProbeBatch.from_token_batch(batch))


def test_step_runs_the_whole_update_and_reports_it():
    model, optimizer = qwen2_and_optimizer()
    batch = backward(model, optimizer, 0)
    before = weights(optimizer)
    report = optimizer.step(logra_inputs=LoGRAStepInputs(probe=ProbeBatch.from_token_batch(batch)))
    assert optimizer.update_count == 1 and not report.skipped and report.update == 0
    assert not any(torch.equal(a, b) for a, b in zip(before, weights(optimizer)))
    assert report.budget == scheduled_budget(optimizer.config, 0)
    assert report.alpha == min(3.0, math.sqrt(report.budget / report.predicted_kl))
    assert report.predicted_kl_scaled == report.alpha**2 * report.predicted_kl
    assert report.update_norm == pytest.approx(1e-2 * report.weight_norm, rel=1e-9)
    assert report.prepare_s > 0 and report.probe_s > 0 and report.apply_s > 0
    assert {"logra/alpha", "logra/budget", "logra/predicted_kl", "logra/skipped_steps", "perf/logra_probe_s"} <= set(report.metrics())


def probe_settings(optimizer) -> dict:
    """The optimizer's probe packing and chunking, so that a direct call sums in the same order
    (with 2 threads, a different packing changes float32 round-off on some CPUs)."""
    return {"max_tokens": optimizer.config.probe_max_tokens, "position_chunk": optimizer.config.probe_chunk_positions}


def test_step_predicts_on_the_first_probe_responses_only():
    model, optimizer = qwen2_and_optimizer(probe_responses=2)
    batch = backward(model, optimizer, 0)
    optimizer.prepare_update(normalization_tokens=1)
    # The same probe settings as the optimizer's: the same packing, so the same float32 sums.
    first_two = probe_predicted_kl(model, optimizer.probe_layers(), ProbeBatch.from_token_batch(batch[:2]),
                                   **probe_settings(optimizer))
    assert optimizer.predict_kl(ProbeBatch.from_token_batch(batch).first_rows(2)) == first_two


def test_measured_kl_of_the_applied_step_matches_the_prediction():
    model, optimizer = qwen2_and_optimizer()
    batch = backward(model, optimizer, 0)
    report = optimizer.step(logra_inputs=LoGRAStepInputs(probe=ProbeBatch.from_token_batch(batch)), measure_kl=True)
    assert report.measured_kl > 0
    # second-order prediction of a small step: a few percent on a tiny model
    assert report.measured_kl == pytest.approx(report.predicted_kl_scaled, rel=0.05)


def test_probe_temperature_is_the_sampling_temperature_unless_set():
    model, optimizer = qwen2_and_optimizer()
    batch = backward(model, optimizer, 0)
    optimizer.prepare_update(normalization_tokens=1)
    layers = optimizer.probe_layers()
    settings = probe_settings(optimizer)
    at_07 = probe_predicted_kl(model, layers, ProbeBatch.from_token_batch(batch[:2]), temperature=0.7, **settings)
    at_1 = probe_predicted_kl(model, layers, ProbeBatch.from_token_batch(batch[:2]), temperature=1.0, **settings)
    assert at_07 > 1.5 * at_1  # the KL of a logit change grows as the temperature falls
    sampled = dataclasses.replace(ProbeBatch.from_token_batch(batch[:2]), temperature=0.7)
    assert optimizer.predict_kl(sampled) == at_07
    optimizer.config.probe_temperature = 1.0  # an explicit value wins over the batch's
    assert optimizer.predict_kl(sampled) == at_1


def test_mismatch_updates_only_on_eos_terminated_responses():
    model, optimizer = qwen2_and_optimizer(kl_budget=1.0, kl_budget_final=1.0)
    batch = backward(model, optimizer, 0)
    report = optimizer.step(logra_inputs=LoGRAStepInputs(ProbeBatch.from_token_batch(batch), eos_pairs(0.3, eos=True)))
    assert report.mismatch == pytest.approx(0.3 * 0.3) and report.budget == pytest.approx(1.0 - 0.09)
    backward(model, optimizer, 1)
    report = optimizer.step(logra_inputs=LoGRAStepInputs(ProbeBatch.from_token_batch(batch), eos_pairs(0.3, eos=False)))
    # no EOS-terminated response: the EMA and the budget are untouched
    assert report.mismatch == pytest.approx(0.09) and report.budget == 1.0
    backward(model, optimizer, 2)
    report = optimizer.step(logra_inputs=LoGRAStepInputs(ProbeBatch.from_token_batch(batch), None))
    assert report.mismatch == pytest.approx(0.09) and report.budget == 1.0


def test_a_probe_with_no_scored_position_skips_the_step_instead_of_an_unscaled_one():
    model, optimizer = qwen2_and_optimizer()
    batch = backward(model, optimizer, 0)
    nothing = ProbeBatch(batch, torch.ones_like(batch), torch.zeros_like(batch, dtype=torch.bool))
    before = weights(optimizer)
    with pytest.warns(UserWarning, match="skipped a step .*scored no position"):
        report = optimizer.step(logra_inputs=LoGRAStepInputs(probe=nothing))
    assert report.skipped and report.alpha is None and report.skipped_steps == optimizer.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, weights(optimizer))) and optimizer.update_count == 0
    _, raising = qwen2_and_optimizer(on_nonfinite="raise")
    backward(raising.model, raising, 0)
    with pytest.raises(EmptyProbeError, match="scored no position"):
        raising.step(logra_inputs=LoGRAStepInputs(probe=nothing))


def test_kl_control_needs_a_probe_and_can_be_turned_off():
    model, optimizer = qwen2_and_optimizer()
    backward(model, optimizer, 0)
    with pytest.raises(ValueError, match="kl_control=false"):
        optimizer.step()
    model, unscaled = qwen2_and_optimizer(kl_control=False)
    backward(model, unscaled, 0)
    report = unscaled.step()
    assert report.alpha == 1.0 and report.predicted_kl is None and unscaled.update_count == 1


def test_step_without_backward_anywhere_does_nothing_when_allowed():
    _, optimizer = qwen2_and_optimizer(kl_control=False)
    assert optimizer.step(allow_no_backward=True) is None and optimizer.update_count == 0
    with pytest.raises(RuntimeError, match="no backward pass"):
        optimizer.step()


def test_state_is_tensors_only_and_loads_with_weights_only():
    model, optimizer = qwen2_and_optimizer()
    batch = backward(model, optimizer, 0)
    optimizer.step(logra_inputs=LoGRAStepInputs(ProbeBatch.from_token_batch(batch), eos_pairs(0.2, eos=True)))
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    _, resumed = qwen2_and_optimizer()
    resumed.load_state_dict(state)
    assert resumed.update_count == 1 and resumed.mismatch == optimizer.mismatch
    for a, b in zip(resumed.sketches, optimizer.sketches):
        assert torch.equal(a.second_moment, b.second_moment) and torch.equal(a.projection, b.projection)


def test_resuming_with_other_tuning_fields_warns_with_old_and_new_values():
    model, optimizer = qwen2_and_optimizer()
    batch = backward(model, optimizer, 0)
    optimizer.step(logra_inputs=LoGRAStepInputs(probe=ProbeBatch.from_token_batch(batch)))
    _, changed = qwen2_and_optimizer(kl_budget=3e-4, update_ratio=5e-3)
    with pytest.warns(UserWarning, match=r"changed settings: update_ratio: 0.01 -> 0.005; kl_budget: 0.0001 -> 0.0003$"):
        changed.load_state_dict(optimizer.state_dict())
    assert changed.update_count == 1 and changed.param_groups[0]["lr"] == 5e-3


def test_targets_called_with_input_as_a_keyword_step_bit_for_bit_the_same():
    """The sketch and the probe's tangent read X from ``input=`` when a model passes it so."""
    positional_model, positional = qwen2_and_optimizer()
    batch = backward(positional_model, positional, 0)
    expected = positional.step(logra_inputs=LoGRAStepInputs(probe=ProbeBatch.from_token_batch(batch)), measure_kl=True)
    keyword_model, keyword = qwen2_and_optimizer()
    for state in keyword.sketches:
        state.module.__class__ = KeywordCalledLinear
    backward(keyword_model, keyword, 0)
    report = keyword.step(logra_inputs=LoGRAStepInputs(probe=ProbeBatch.from_token_batch(batch)), measure_kl=True)
    assert report.predicted_kl > 0 and report.predicted_kl == expected.predicted_kl
    assert report.measured_kl == expected.measured_kl
    for got, want in zip(weights(keyword), weights(positional)):
        assert torch.equal(got, want)
