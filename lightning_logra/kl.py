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
from torch.overrides import TorchFunctionMode

from lightning_logra.config import LoGRAConfig


def kl_per_position(logits: torch.Tensor, tangent: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """0.5 * sum_v p_v (u_v - E_p[u])^2 per position, in float64 (last dim = vocabulary)."""
    # In place on float64 copies: this runs on (positions x vocabulary) blocks, where each
    # extra temporary is as large as the block itself.
    p = torch.softmax(logits.to(torch.float64) / temperature, dim=-1)
    u = tangent.to(torch.float64, copy=True).div_(temperature)
    mean = torch.linalg.vecdot(p, u).unsqueeze(-1)
    return 0.5 * torch.linalg.vecdot(p, u.sub_(mean).square_())


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
    position_chunk: int = 128,
    process_group: dist.ProcessGroup | None = None,
    distributed: bool = False,
    position_ids: torch.Tensor | None = None,
) -> float:
    """Predicted KL of the update W -= D A of every layer at once, over the probe batch.

    ``logits_mask`` marks the logit positions to score: position t is the distribution
    that generated token t+1, so for generated tokens it is the completion mask shifted
    left by one. Sequences are truncated to ``max_tokens``. The probe runs one sequence
    per forward, and SDPA attention in blocks of ``position_chunk`` queries, so neither the
    batch nor a (length x length) score matrix multiplies the memory of forward AD, which
    keeps a primal and a tangent of every activation. Full-vocabulary logits exist for
    ``position_chunk`` positions at a time when the model exposes its output head
    (``get_output_embeddings``). With ``distributed``, the sum and count are all-reduced
    over ``process_group`` and every rank returns the global mean; ranks run the same
    number of forwards (sharded models gather weights in each). ``position_ids``, when
    given, are passed to the model (left-padded rows scored as they were generated).
    """
    if max_tokens is not None:
        input_ids, attention_mask, logits_mask = (t[:, :max_tokens] for t in (input_ids, attention_mask, logits_mask))
        position_ids = position_ids[:, :max_tokens] if position_ids is not None else None
    logits_mask = logits_mask.to(torch.bool)
    rows = input_ids.shape[0]
    if rows == 0:
        raise ValueError("the KL probe needs at least one sequence")
    forwards = rows
    if distributed:
        count = torch.tensor([rows], device=input_ids.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=process_group)
        forwards = int(count.item())
    totals = torch.zeros(2, dtype=torch.float64, device=input_ids.device)  # (sum of KL, positions)

    def accumulate(logits: torch.Tensor) -> None:
        primal, tangent = fwAD.unpack_dual(logits)
        tangent = torch.zeros_like(primal) if tangent is None else tangent
        for chunk in _chunks(primal.shape[0], position_chunk):
            totals[0] += kl_per_position(primal[chunk], tangent[chunk], temperature=temperature).sum()
        totals[1] += primal.shape[0]

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    with _probe_mode(model, position_chunk), fwAD.dual_level():
        handles = [layer.module.register_forward_hook(_tangent_hook(layer)) for layer in layers]
        try:
            for index in range(forwards):
                # A rank with fewer sequences repeats its last one, scoring nothing.
                row = slice(min(index, rows - 1), min(index, rows - 1) + 1)
                scored = logits_mask[row] if index < rows else torch.zeros_like(logits_mask[row])
                inputs = {"input_ids": input_ids[row], "attention_mask": attention_mask[row]}
                if position_ids is not None:
                    inputs["position_ids"] = position_ids[row]
                if isinstance(head, nn.Linear):
                    head_hook = head.register_forward_pre_hook(_chunked_head_hook(scored, position_chunk, accumulate))
                    try:
                        model(**inputs)
                    finally:
                        head_hook.remove()
                else:
                    output = model(**inputs)
                    accumulate((output.logits if hasattr(output, "logits") else output)[scored])
        finally:
            for handle in handles:
                handle.remove()
    if distributed:
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=process_group)
    return float(totals[0] / totals[1]) if totals[1] > 0 else 0.0


def _tangent_hook(layer: ProbeLayer):
    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        primal, tangent = fwAD.unpack_dual(output)
        # The output's dtype, not the input's: under autocast a float32 input gives a
        # bfloat16 output, and the in-place update below does not autocast.
        dtype = primal.dtype
        inputs = fwAD.unpack_dual(args[0]).primal.to(dtype)
        projected = inputs.reshape(-1, inputs.shape[-1]) @ layer.projection.to(dtype).T
        direction = layer.direction.to(dtype)
        if tangent is None:
            return fwAD.make_dual(primal, (projected @ direction.T).neg_().view_as(primal))
        if not tangent.is_contiguous():
            return fwAD.make_dual(primal, tangent - (projected @ direction.T).view_as(primal))
        # The layer's own tangent is a fresh tensor: add -(X A^T) D^T into it in place
        # rather than holding a second (tokens x out_features) temporary.
        tangent.view(-1, tangent.shape[-1]).addmm_(projected, direction.T, alpha=-1)
        return fwAD.make_dual(primal, tangent)

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


class _BlockedAttention(TorchFunctionMode):
    """``F.scaled_dot_product_attention`` computed in blocks of queries, in plain ops that
    forward AD differentiates, so a (block x keys) score matrix is the largest it makes.

    Same semantics as SDPA: boolean masks keep True, float masks are added, ``is_causal``
    is aligned top-left, grouped-query attention with ``enable_gqa``; a query that may
    attend to nothing gets a zero output rather than NaN, so a masked padding position
    cannot poison the tangents of the positions that follow it.
    """

    def __init__(self, block: int):
        super().__init__()
        self.block = block

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        return self._attention(*args, **kwargs)

    def _attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if dropout_p != 0.0:
            raise ValueError("the KL probe runs the model in eval mode; attention dropout must be 0")
        scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
        groups = query.shape[-3] // key.shape[-3]
        if groups > 1:
            key, value = key.repeat_interleave(groups, dim=-3), value.repeat_interleave(groups, dim=-3)
        blocks = []
        for rows in _chunks(query.shape[-2], self.block):
            # Under is_causal, keys after the block's last query are never attended: skip them.
            keys = slice(0, min(rows.stop, key.shape[-2])) if is_causal else slice(None)
            scores = (query[..., rows, :] @ key[..., keys, :].transpose(-2, -1)) * scale
            allowed = None
            if is_causal:
                key_index = torch.arange(scores.shape[-1], device=query.device)
                allowed = key_index <= torch.arange(rows.start, rows.stop, device=query.device)[:, None]
            if attn_mask is not None:
                mask = attn_mask[..., rows, :] if attn_mask.shape[-2] > 1 else attn_mask
                if mask.dtype == torch.bool:
                    allowed = mask if allowed is None else allowed & mask
                else:
                    scores = scores + mask
            if allowed is not None:
                scores = scores.masked_fill(~allowed, float("-inf"))
            weights = torch.softmax(scores, dim=-1)
            if allowed is not None:
                sees_something = allowed.any(dim=-1, keepdim=True)
                if not bool(sees_something.all()):
                    weights = torch.where(sees_something, weights, torch.zeros_like(weights))
            blocks.append(weights @ value[..., keys, :])
        return torch.cat(blocks, dim=-2)


@contextmanager
def _probe_mode(model: nn.Module, attention_block: int):
    """Eval mode, no grad, and blocked SDPA attention that supports forward AD; every
    module's train/eval flag and the attention implementation are restored afterwards,
    even on error."""
    modes = [(module, module.training) for module in model.modules()]
    config = getattr(model, "config", None)
    attention = getattr(config, "_attn_implementation", None)
    switch = attention not in (None, "eager", "sdpa") and hasattr(model, "set_attn_implementation")
    try:
        if switch:
            model.set_attn_implementation("sdpa")
        model.eval()
        with torch.no_grad(), _BlockedAttention(attention_block):
            yield
    finally:
        for module, training in modes:
            module.training = training
        if switch:
            model.set_attn_implementation(attention)
