"""Predicted-KL control: how far will this update move the policy, and how far may it go?

KL(alpha * Delta) ~= alpha^2 * KL(Delta) to second order, where KL(Delta) is the softmax
Fisher quadratic form of the logits' change. The change is obtained exactly (to first
order) by one forward-mode AD pass that injects every target's output change
dY = -(X A^T) D^T as a tangent; weights are never modified to predict.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.autograd.forward_ad as fwAD
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_logra.config import LoGRAConfig


def kl_per_position(logits: torch.Tensor, tangent: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """0.5 * sum_v p_v (u_v - E_p[u])^2 per position, in float64 (last dim = vocabulary)."""
    scaled = logits.to(torch.float64) / temperature
    u = tangent.to(torch.float64) / temperature
    p = torch.softmax(scaled, dim=-1)
    centred = u - (p * u).sum(dim=-1, keepdim=True)
    return 0.5 * (p * centred.square()).sum(dim=-1)


def predicted_kl(
    logits: torch.Tensor,
    tangent: torch.Tensor,
    *,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean predicted KL over the positions selected by ``mask`` (all positions if None)."""
    per_position = kl_per_position(logits, tangent, temperature=temperature)
    if mask is None:
        return per_position.mean()
    mask = mask.to(torch.bool)
    if not mask.any():
        return per_position.new_zeros(())
    return per_position[mask].mean()


def measured_kl(
    logits_before: torch.Tensor,
    logits_after: torch.Tensor,
    *,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact KL(p_before || p_after) over the full vocabulary, averaged over positions."""
    log_p = torch.log_softmax(logits_before.to(torch.float64) / temperature, dim=-1)
    log_q = torch.log_softmax(logits_after.to(torch.float64) / temperature, dim=-1)
    per_position = (log_p.exp() * (log_p - log_q)).sum(dim=-1)
    if mask is None:
        return per_position.mean()
    return per_position[mask.to(torch.bool)].mean()


def kl_step_scale(prediction: float, *, budget: float, alpha_max: float = 3.0) -> float:
    """alpha = min(alpha_max, sqrt(budget / prediction)); 1 when the prediction is exactly 0."""
    prediction = float(prediction)
    if not (math.isfinite(budget) and budget > 0):
        raise FloatingPointError(f"KL budget must be a finite number > 0, got {budget}")
    if math.isnan(prediction) or prediction < 0.0:
        raise FloatingPointError(f"predicted KL must be a finite number >= 0, got {prediction}")
    if math.isinf(prediction):
        raise FloatingPointError("predicted KL is infinite; refusing to scale the update")
    if prediction == 0.0:
        return 1.0
    return min(alpha_max, math.sqrt(budget / prediction))


def scheduled_budget(config: LoGRAConfig, update: int) -> float:
    """Cosine from kl_budget to kl_budget_final over schedule_steps updates, then flat."""
    start, final, horizon = config.kl_budget, config.kl_budget_final, config.schedule_steps
    progress = min(update / (horizon - 1), 1.0) if horizon > 1 else 1.0
    return final + 0.5 * (start - final) * (1.0 + math.cos(math.pi * progress))


def mismatch_sums(rollout_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(sum of rollout - trainer log-probs, token count) over the masked tokens, float64:
    the two numbers to all-reduce before taking the mean across ranks."""
    mask = mask.to(torch.bool)
    gap = rollout_logprobs.to(torch.float64) - trainer_logprobs.to(torch.float64)
    return torch.stack([gap[mask].sum(), mask.sum().to(torch.float64)])


def observed_mismatch(
    rollout_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, mask: torch.Tensor
) -> float:
    """max(0, mean(rollout - trainer)) over the masked tokens (EOS-terminated responses)."""
    return observed_mismatch_from_sums(mismatch_sums(rollout_logprobs, trainer_logprobs, mask))


def observed_mismatch_from_sums(sums: torch.Tensor) -> float:
    gap_sum, count = sums.tolist()
    return max(0.0, gap_sum / count) if count > 0 else 0.0


def update_mismatch(previous: float, observed: float, *, ema_weight: float = 0.3) -> float:
    return (1.0 - ema_weight) * previous + ema_weight * observed


def effective_budget(budget: float, mismatch: float, *, floor: float = 0.5) -> float:
    """Subtract the rollout/trainer mismatch from the budget, keeping at least floor * budget."""
    return max(budget - mismatch, floor * budget)


@dataclass(frozen=True)
class ProbeLayer:
    """One target as the probe sees it: its module, projection A and full direction D."""

    module: nn.Module
    projection: torch.Tensor  # rank x in_features
    direction: torch.Tensor  # out_features x rank (every row, not only a local shard)


def probe_predicted_kl(
    model: nn.Module,
    layers: Sequence[ProbeLayer],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    max_tokens: int | None = None,
    position_chunk: int = 256,
    process_group: dist.ProcessGroup | None = None,
    distributed: bool = False,
    position_ids: torch.Tensor | None = None,
) -> float:
    """Predicted KL of the update W -= D A of every layer at once, over the probe batch.

    ``logits_mask`` marks the logit positions to score: position t is the distribution
    that generated token t+1, so for generated tokens it is the completion mask shifted
    left by one. Sequences are truncated to ``max_tokens``. Full-vocabulary logits exist
    for ``position_chunk`` positions at a time when the model exposes its output head
    (``get_output_embeddings``). With ``distributed``, the sum and count are all-reduced
    over ``process_group`` and every rank returns the global mean. ``position_ids``, when
    given, are passed to the model (left-padded rows scored as they were generated).
    """
    if max_tokens is not None:
        input_ids, attention_mask, logits_mask = (t[:, :max_tokens] for t in (input_ids, attention_mask, logits_mask))
        position_ids = position_ids[:, :max_tokens] if position_ids is not None else None
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if position_ids is not None:
        inputs["position_ids"] = position_ids
    logits_mask = logits_mask.to(torch.bool)
    totals = torch.zeros(2, dtype=torch.float64, device=input_ids.device)  # (sum of KL, positions)

    def accumulate(logits: torch.Tensor) -> None:
        primal, tangent = fwAD.unpack_dual(logits)
        tangent = torch.zeros_like(primal) if tangent is None else tangent
        for chunk in _chunks(primal.shape[0], position_chunk):
            totals[0] += kl_per_position(primal[chunk], tangent[chunk], temperature=temperature).sum()
        totals[1] += primal.shape[0]

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    with _probe_mode(model), fwAD.dual_level():
        handles = [layer.module.register_forward_hook(_tangent_hook(layer)) for layer in layers]
        try:
            if isinstance(head, nn.Linear):
                handles.append(head.register_forward_pre_hook(_chunked_head_hook(logits_mask, position_chunk, accumulate)))
                model(**inputs)
            else:
                output = model(**inputs)
                accumulate((output.logits if hasattr(output, "logits") else output)[logits_mask])
        finally:
            for handle in handles:
                handle.remove()
    if distributed:
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=process_group)
    return float(totals[0] / totals[1]) if totals[1] > 0 else 0.0


def _tangent_hook(layer: ProbeLayer):
    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        inputs = fwAD.unpack_dual(args[0]).primal
        dtype = inputs.dtype
        projected = inputs.reshape(-1, inputs.shape[-1]) @ layer.projection.to(dtype).T
        delta = -(projected @ layer.direction.to(dtype).T)
        primal, tangent = fwAD.unpack_dual(output)
        delta = delta.view_as(primal)
        return fwAD.make_dual(primal, delta if tangent is None else tangent + delta)

    return hook


def _chunked_head_hook(logits_mask: torch.Tensor, position_chunk: int, accumulate):
    """Score the selected positions in chunks inside the head's own forward, then let the
    head compute a single position: the full (batch x length x vocab) logits never exist."""

    def hook(module: nn.Linear, args: tuple) -> tuple:
        hidden = args[0]
        selected = hidden[logits_mask]
        for chunk in _chunks(selected.shape[0], position_chunk):
            accumulate(F.linear(selected[chunk], module.weight, module.bias))
        return (hidden[:, :1],) + tuple(args[1:])

    return hook


def _chunks(total: int, size: int) -> Iterator[slice]:
    for start in range(0, total, size):
        yield slice(start, min(start + size, total))


@contextmanager
def _probe_mode(model: nn.Module):
    """Eval mode, no grad, and an attention path that supports forward AD; every module's
    train/eval flag and the attention implementation are restored afterwards, even on error."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    modes = [(module, module.training) for module in model.modules()]
    config = getattr(model, "config", None)
    attention = getattr(config, "_attn_implementation", None)
    switch = attention not in (None, "eager", "sdpa") and hasattr(model, "set_attn_implementation")
    try:
        if switch:
            model.set_attn_implementation("sdpa")
        model.eval()
        with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]):
            yield
    finally:
        for module, training in modes:
            module.training = training
        if switch:
            model.set_attn_implementation(attention)
