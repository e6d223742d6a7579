"""LoGRACallback: the KL controller's alpha, budget and logged metrics under the Trainer."""

import dataclasses
import math
import warnings

import pytest
import torch
from lightning.pytorch.loggers import Logger

from lightning_logra import LoGRACallback, LoGRAFSDPStrategy, LoGRAStepInputs, scheduled_budget
from tests.helpers.lightning import CausalLM, config, loader, trainer

EXPECTED_KEYS = {
    "logra/predicted_kl", "logra/predicted_kl_scaled", "logra/alpha", "logra/budget", "logra/mismatch",
    "logra/mismatch_nonfinite_pairs", "logra/sketch_norm", "logra/measured_kl", "memory/logra_state_mib",
    "memory/dense_equivalent_mib", "memory/peak_rss_mib",
}


class RecordingLogger(Logger):
    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self):
        return "recording"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))


class WithMismatch(CausalLM):
    """Reports a rollout/trainer gap of exactly 0.3 nats per token."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        trainer_logprobs = torch.full((2, 3), -1.0)
        pairs = (trainer_logprobs + 0.3, trainer_logprobs, torch.ones(2, 3))
        optimizer.step(closure=optimizer_closure, logra_inputs=LoGRAStepInputs(logprob_pairs=pairs))


def fit(module, logra, steps=3):
    logger = RecordingLogger()
    strategy = LoGRAFSDPStrategy(logra=dataclasses.replace(logra, kl_control=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(strategy, max_steps=steps, logger=logger, log_every_n_steps=1,
                callbacks=[LoGRACallback(measure_kl=True)]).fit(module, loader(4))
    return [metrics for _, metrics in logger.rows if "logra/alpha" in metrics]


def test_alpha_budget_and_logged_keys_follow_the_controller():
    logra = config(update_ratio=1e-2, kl_budget=1e-4, kl_budget_final=1e-5, schedule_steps=3)
    rows = fit(CausalLM(), logra)
    assert len(rows) == 3
    for update, metrics in enumerate(rows):
        assert EXPECTED_KEYS <= set(metrics)
        budget = scheduled_budget(logra, update)
        assert metrics["logra/budget"] == pytest.approx(budget, rel=1e-6)
        expected_alpha = min(logra.alpha_max, math.sqrt(budget / metrics["logra/predicted_kl"]))
        assert metrics["logra/alpha"] == pytest.approx(expected_alpha, rel=1e-5)
        assert metrics["logra/predicted_kl_scaled"] == pytest.approx(metrics["logra/alpha"] ** 2 * metrics["logra/predicted_kl"], rel=1e-5)
        if metrics["logra/alpha"] < logra.alpha_max:  # a step scaled to the budget lands on it
            assert metrics["logra/predicted_kl_scaled"] == pytest.approx(budget, rel=1e-5)
        assert metrics["logra/measured_kl"] == pytest.approx(metrics["logra/predicted_kl_scaled"], rel=0.05)
        assert metrics["memory/logra_state_mib"] < metrics["memory/dense_equivalent_mib"]


def test_mismatch_is_an_ema_subtracted_from_the_budget_with_a_floor():
    logra = config(update_ratio=1e-2, kl_budget=1.0, kl_budget_final=1.0)
    rows = fit(WithMismatch(), logra, steps=2)
    assert rows[0]["logra/mismatch"] == pytest.approx(0.3 * 0.3)
    assert rows[1]["logra/mismatch"] == pytest.approx(0.7 * 0.09 + 0.3 * 0.3)
    assert rows[1]["logra/budget"] == pytest.approx(1.0 - (0.7 * 0.09 + 0.3 * 0.3))
    floored = fit(WithMismatch(), config(kl_budget=0.1, kl_budget_final=0.1), steps=1)
    assert floored[0]["logra/budget"] == pytest.approx(max(0.1 - 0.09, 0.05))
