"""Which responses the KL probe scores (``kl_probe``): the authors' first rows, kept bit for
bit, and the stratified rows whose weights make them stand for the whole batch."""

import pytest
import torch

from lightning_logra import LoGRAStepInputs, ProbeBatch, probe_predicted_kl
from lightning_logra.core.probe_batch import share_weighted_rows, stratified_rows
from tests.helpers.core import backward, qwen2_and_optimizer, weights


def probe_settings(optimizer) -> dict:
    return {"max_tokens": optimizer.config.probe_max_tokens, "position_chunk": optimizer.config.probe_chunk_positions}


def test_reference_probes_the_first_two_rows_unweighted_bit_for_bit():
    # The path the authors' probe takes, and ours before issue 41: the step's prediction is
    # the plain mean over the first 2 rows' positions, and the weights are those of an update
    # scaled by it.
    model, optimizer = qwen2_and_optimizer(kl_probe="reference")
    batch = backward(model, optimizer, 0)
    report = optimizer.step(logra_inputs=LoGRAStepInputs(ProbeBatch.from_token_batch(batch)))
    by_hand_model, by_hand = qwen2_and_optimizer(kl_probe="reference")
    backward(by_hand_model, by_hand, 0)
    by_hand.prepare_update(normalization_tokens=1)
    first_two = probe_predicted_kl(by_hand_model, by_hand.probe_layers(), ProbeBatch.from_token_batch(batch[:2]),
                                   **probe_settings(by_hand))
    assert report.predicted_kl == first_two
    by_hand.apply_update(alpha=report.alpha, budget=by_hand.controller.budget(0, None))
    assert all(torch.equal(a, b) for a, b in zip(weights(optimizer), weights(by_hand)))


def test_stratified_with_a_stratum_per_row_is_the_mean_over_every_row():
    model, optimizer = qwen2_and_optimizer(probe_responses=16)  # more strata than the batch's 4 rows
    batch = backward(model, optimizer, 0)
    optimizer.prepare_update(normalization_tokens=1)
    every_row = probe_predicted_kl(model, optimizer.probe_layers(), ProbeBatch.from_token_batch(batch),
                                   **probe_settings(optimizer))
    drawn = ProbeBatch.from_token_batch(batch).stratified(16, max_tokens=None, generator=torch.Generator())
    assert drawn.row_weights.tolist() == [1.0] * 4
    # Weighted by ones: the same sum, accumulated in float64 in another order.
    assert optimizer.predict_kl(drawn) == pytest.approx(every_row, rel=1e-12)


def test_measured_kl_is_weighted_like_the_prediction():
    model, optimizer = qwen2_and_optimizer(probe_responses=2)
    batch = backward(model, optimizer, 0)
    report = optimizer.step(logra_inputs=LoGRAStepInputs(ProbeBatch.from_token_batch(batch)), measure_kl=True)
    # second-order prediction of a small step: a few percent on a tiny model
    assert report.measured_kl == pytest.approx(report.predicted_kl_scaled, rel=0.05)


def test_strata_follow_the_key_and_their_weights_stand_for_every_position():
    positions = torch.tensor([4.0, 6.0, 2.0, 8.0, 5.0, 5.0])
    keys = torch.tensor([0.5, -1.0, 2.0, 0.0, 3.0, -2.0])  # sorted: rows 5, 1, 3, 0, 2, 4
    chosen, weights = stratified_rows(positions, positions.tolist(), keys, 3, torch.Generator().manual_seed(0))
    # Strata of about 10 positions each in key order: {5, 1}, {3, 0}, {2, 4}.
    assert [row in group for row, group in zip(chosen, ({5, 1}, {3, 0}, {2, 4}))] == [True] * 3
    assert sum(w * positions[row].item() for row, w in zip(chosen, weights)) == pytest.approx(30.0, rel=1e-15)
    # Rows nothing can be scored on are never drawn; a batch without any yields nothing.
    chosen, _ = stratified_rows(positions, [0, 6, 0, 8, 0, 0], keys, 3, torch.Generator().manual_seed(0))
    assert set(chosen) <= {1, 3}
    assert stratified_rows(positions, [0] * 6, keys, 3, torch.Generator()) == ([], [])
    # No more usable rows than strata: every one is drawn, standing for its own positions.
    chosen, weights = stratified_rows(torch.tensor([1.0, 100.0]), [1, 50], torch.tensor([0.0, 1.0]), 8, torch.Generator())
    assert (chosen, weights) == ([0, 1], [1.0, 2.0])


def test_the_weighted_sum_is_an_unbiased_estimate_of_the_batch_total():
    # A skewed per-position value: one row holds most of the total, as a step's KL does.
    positions = torch.tensor([10.0, 12.0, 8.0, 16.0, 9.0, 14.0, 11.0, 7.0])
    row_totals = torch.tensor([0.1, 0.2, 0.1, 3.0, 0.2, 0.1, 0.3, 0.1]) * positions
    keys = torch.arange(8.0)
    generator = torch.Generator().manual_seed(0)
    estimates = []
    for _ in range(20_000):
        chosen, weights = stratified_rows(positions, positions.tolist(), keys, 3, generator)
        estimates.append(sum(w * row_totals[row].item() for row, w in zip(chosen, weights)))
    estimates = torch.tensor(estimates, dtype=torch.float64)
    standard_error = estimates.std() / len(estimates) ** 0.5
    assert abs(estimates.mean() - row_totals.sum()) < 4 * standard_error
    assert standard_error < 0.01 * row_totals.sum()  # power to see a 4% bias


def test_weighted_probes_a_rare_outcome_for_certain_and_stands_for_every_position():
    # One success among failures (advantage 2.47 against -0.35) and rows of groups without
    # a signal (0), as in a two-digit-sum batch: the success's expected share of the KL
    # exceeds a stratum's, so it is probed in every draw and stands only for itself.
    positions = torch.tensor([16.0] * 16)
    keys = torch.tensor([2.47] + [-0.35] * 7 + [0.0] * 8)
    for seed in range(20):
        chosen, weights = share_weighted_rows(positions, positions.tolist(), keys, 4, torch.Generator().manual_seed(seed))
        assert chosen[0] == 0 and weights[0] == 1.0 and len(chosen) == 4
    # Equal-position strata (``stratified``) leave it to a draw in a stratum of 4 rows.
    drawn = {0 in stratified_rows(positions, positions.tolist(), keys, 4, torch.Generator().manual_seed(seed))[0]
             for seed in range(20)}
    assert drawn == {True, False}
    # Keys all 0: strata of equal positions, a long row for certain.
    chosen, weights = share_weighted_rows(torch.tensor([40.0, 10.0, 10.0, 10.0, 10.0]), [40, 10, 10, 10, 10],
                                          torch.zeros(5), 2, torch.Generator().manual_seed(0))
    assert (chosen[0], weights) == (0, [1.0, 4.0])
    # Rows nothing can be scored on are never drawn; too few rows: every one, for itself.
    chosen, _ = share_weighted_rows(positions[:6], [0, 6, 0, 8, 0, 16], keys[:6], 2, torch.Generator().manual_seed(0))
    assert set(chosen) <= {1, 3, 5}
    assert share_weighted_rows(positions[:6], [0] * 6, keys[:6], 2, torch.Generator()) == ([], [])
    assert share_weighted_rows(torch.tensor([1.0, 100.0]), [1, 50], torch.tensor([0.0, 1.0]), 8,
                               torch.Generator()) == ([0, 1], [1.0, 2.0])


def test_weighted_sums_are_unbiased_and_closer_than_equal_position_strata_on_a_skewed_batch():
    # Per-position KL about 8x as large on the rare success's row as on the others (as in a
    # quickstart update), and varying from row to row, unlike the rule's expected shares.
    positions = torch.tensor([10.0, 12.0, 8.0, 16.0, 9.0, 14.0, 11.0, 7.0, 13.0, 15.0])
    keys = torch.tensor([0.0, 0.0, -0.35, -0.35, 2.47, -0.35, 0.0, 0.0, -0.35, 0.0])
    rates = torch.tensor([0.010, 0.014, 0.012, 0.020, 0.12, 0.009, 0.011, 0.016, 0.013, 0.008], dtype=torch.float64)
    row_totals = positions.double() * rates
    generator = torch.Generator().manual_seed(0)

    def estimates(rule):
        values = []
        for _ in range(20_000):
            chosen, weights = rule(positions, positions.tolist(), keys, 3, generator)
            values.append(sum(w * row_totals[row].item() for row, w in zip(chosen, weights)))
        return torch.tensor(values, dtype=torch.float64)

    weighted, stratified = estimates(share_weighted_rows), estimates(stratified_rows)
    standard_error = weighted.std() / len(weighted) ** 0.5
    assert abs(weighted.mean() - row_totals.sum()) < 4 * standard_error
    assert standard_error < 0.01 * row_totals.sum()  # power to see a 4% bias
    assert weighted.std() < 0.5 * stratified.std()
