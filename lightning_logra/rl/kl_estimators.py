"""Per-token estimators of KL(policy || reference) from tokens sampled from the policy
(Schulman's k1, k2, k3, and the clamped k3 verl calls ``low_var_kl``), written in the log
ratio ``x = log reference - log policy`` of each sampled token.

Over tokens drawn from the policy, k1 and k3 average to the KL exactly; k2 averages to
``E[x**2] / 2``, which agrees with the KL to second order. k3 is never negative and has the
lowest variance of the unbiased two when the distributions are close (the default).
"""

import torch

KL_ESTIMATORS = ("k1", "k2", "k3", "low_var")
# low_var: the log ratio and the estimate are clamped, as verl's low_var_kl does, so that one
# token far off the reference cannot dominate the penalty (exp(20) is 4.9e8).
LOW_VAR_LOG_RATIO, LOW_VAR_MAX = 20.0, 10.0


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """``exp(x) - x - 1`` per token of log ratios ``x = log q - log p``: never negative, and
    its mean over tokens sampled from p is an unbiased estimate of KL(p || q)."""
    return log_ratio.exp() - log_ratio - 1


def kl_estimate(log_ratio: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """The per-token estimate ``estimator`` (one of ``KL_ESTIMATORS``) of KL(policy ||
    reference) from ``log_ratio = log reference - log policy`` at tokens sampled from the policy."""
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return log_ratio.square() / 2
    if estimator == "k3":
        return k3(log_ratio)
    if estimator == "low_var":
        return k3(log_ratio.clamp(-LOW_VAR_LOG_RATIO, LOW_VAR_LOG_RATIO)).clamp(max=LOW_VAR_MAX)
    raise ValueError(f"estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
