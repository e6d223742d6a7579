"""The forward-mode probe: how would the prepared update move the policy's logits?

Every target's output change dY = -(X A^T) D^T is injected as a tangent in one
forward-mode AD pass, so the logits' tangent is the exact Jacobian-vector product of the
whole update; weights are never modified to predict. The Fisher form that turns the
logits' change into a KL is in ``kl.py``; this module is the model machinery: which
positions are scored, attention that forward AD can differentiate, and a head that never
forms full logits.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.autograd.forward_ad as fwAD
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_logra.kl import kl_per_position, measured_kl
from lightning_logra.projected_input import SharedProjectedInput, project


class EmptyProbeError(FloatingPointError):
    """The probe scored no position on any rank: there is no prediction to scale the step
    by, and an unscaled step must never be applied in its place. A ``FloatingPointError``
    so that ``on_nonfinite: skip`` skips the step like any other unsafe one."""


@dataclass(frozen=True)
class ProbeLayer:
    """One target as the probe sees it: its module, projection A and full direction D, and
    the cache its projection group shares P = X A^T through (``share_projection_by_input``)."""

    module: nn.Module
    projection: torch.Tensor  # rank x in_features
    direction: torch.Tensor  # out_features x rank (every row, not only a local shard)
    shared: SharedProjectedInput | None = None


@dataclass(frozen=True)
class ProbeBatch:
    """Responses that were already generated, and which logit positions to score.

    ``logits_mask[:, t]`` marks the distribution that generated token t+1 (for completions:
    the completion mask shifted left by one). ``temperature`` is the sampling temperature
    the responses were drawn at. ``position_ids``, when given, are passed to the model.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    logits_mask: torch.Tensor
    position_ids: torch.Tensor | None = None
    temperature: float = 1.0

    @classmethod
    def from_mapping(cls, values: Mapping) -> ProbeBatch:
        """From a dict such as ``LightningModule.logra_probe_batch()`` returns."""
        if isinstance(values, ProbeBatch):
            return values
        missing = {"input_ids", "attention_mask", "logits_mask"} - set(values)
        if missing:
            raise ValueError(f"the LoGRA probe batch lacks {sorted(missing)}; it needs input_ids, attention_mask, logits_mask")
        return cls(
            input_ids=values["input_ids"],
            attention_mask=values["attention_mask"],
            logits_mask=values["logits_mask"].to(torch.bool),
            position_ids=values.get("position_ids"),
            temperature=float(values.get("temperature", 1.0)),
        )

    @classmethod
    def from_token_batch(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> ProbeBatch:
        """Every position of a language-modelling batch that predicts a real next token."""
        attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        real = attention_mask.bool()
        logits_mask = torch.zeros_like(real)
        logits_mask[:, :-1] = real[:, :-1] & real[:, 1:]
        return cls(input_ids=input_ids, attention_mask=attention_mask, logits_mask=logits_mask)

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    def first_rows(self, count: int) -> ProbeBatch:
        keep = slice(0, count)
        position_ids = None if self.position_ids is None else self.position_ids[keep]
        return replace(self, input_ids=self.input_ids[keep], attention_mask=self.attention_mask[keep],
                       logits_mask=self.logits_mask[keep], position_ids=position_ids)

    def row_inputs(self, row: int, max_tokens: int | None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Model inputs and logits mask of one row: its real tokens only (padding on either
        side dropped), at most ``max_tokens`` of them. This is the one place the probe is
        truncated, so ``max_tokens`` counts real tokens, never left padding."""
        start, stop = self._span(row, max_tokens)
        span = slice(start, max(stop, start + 1))  # a model needs at least one token
        inputs = {"input_ids": self.input_ids[row : row + 1, span], "attention_mask": self.attention_mask[row : row + 1, span]}
        if self.position_ids is not None:
            inputs["position_ids"] = self.position_ids[row : row + 1, span]
        scored = self.logits_mask[row : row + 1, span].clone()
        if stop <= start:
            scored.zero_()
        return inputs, scored


    def packed_groups(self, max_tokens: int | None) -> list[list[int]]:
        """Rows packed into forwards: consecutive rows share one (right-padded) forward while
        rows x longest stays within the tokens of one full row (``max_tokens``, or the
        longest row when None). Short responses then run as one batch, which is several
        times faster than one small forward each, and no forward is larger than one row."""
        lengths = [stop - start for start, stop in (self._span(row, max_tokens) for row in range(self.rows))]
        budget = max_tokens if max_tokens is not None else max(lengths)
        groups: list[list[int]] = []
        longest = 0
        for row, length in enumerate(lengths):
            if groups and (len(groups[-1]) + 1) * max(longest, length) <= budget:
                groups[-1].append(row)
                longest = max(longest, length)
            else:
                groups.append([row])
                longest = length
        return groups

    def packed_inputs(self, rows: Sequence[int], max_tokens: int | None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """``row_inputs`` of several rows, right-padded to the longest into one batch
        (padding is masked out and never scored)."""
        parts = [self.row_inputs(row, max_tokens) for row in rows]
        if len(parts) == 1:
            return parts[0]
        longest = max(scored.shape[1] for _, scored in parts)

        def stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat([F.pad(tensor, (0, longest - tensor.shape[1])) for tensor in tensors])

        inputs = {key: stacked([part[key] for part, _ in parts]) for key in parts[0][0]}
        return inputs, stacked([scored for _, scored in parts])

    def _span(self, row: int, max_tokens: int | None) -> tuple[int, int]:
        """[start, stop) of the row's real tokens, at most ``max_tokens`` of them."""
        real = self.attention_mask[row].nonzero()
        if real.numel() == 0:
            return 0, 0
        start, stop = int(real[0]), int(real[-1]) + 1
        if max_tokens is not None:
            stop = min(stop, start + max_tokens)
        return start, stop


def probe_predicted_kl(
    model: nn.Module,
    layers: Sequence[ProbeLayer],
    batch: ProbeBatch,
    *,
    temperature: float | None = None,
    max_tokens: int | None = None,
    position_chunk: int = 128,
    process_group: dist.ProcessGroup | None = None,
) -> float:
    """Predicted KL of the update W -= D A of every layer at once, averaged over the scored
    positions of ``batch`` (at ``temperature``, default the batch's own).

    The probe runs at most one full row's tokens per forward (short rows packed together),
    and SDPA attention in blocks of ``position_chunk`` queries, so neither the batch nor a
    (length x length) score matrix multiplies the memory of forward AD, which keeps a primal and a tangent of every
    activation. Full-vocabulary logits exist for ``position_chunk`` positions at a time
    when the model exposes its output head (``get_output_embeddings``). With a
    ``process_group`` the sum and count are all-reduced over it and every rank returns the
    global mean; ranks then run the same number of forwards (sharded models gather weights
    in each). ``None`` probes locally. No scored position anywhere is an ``EmptyProbeError``.
    """
    temperature = batch.temperature if temperature is None else temperature
    totals = torch.zeros(2, dtype=torch.float64, device=batch.input_ids.device)  # (sum of KL, positions)

    def accumulate(logits: torch.Tensor) -> None:
        primal, tangent = fwAD.unpack_dual(logits)
        tangent = torch.zeros_like(primal) if tangent is None else tangent
        for chunk in _chunks(primal.shape[0], position_chunk):
            totals[0] += kl_per_position(primal[chunk], tangent[chunk], temperature=temperature).sum(dtype=torch.float64)
        totals[1] += primal.shape[0]

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    with _probe_mode(model, position_chunk), fwAD.dual_level():
        handles = [layer.module.register_forward_hook(_tangent_hook(layer)) for layer in layers]
        try:
            for inputs, scored in _forwards(batch, max_tokens, process_group):
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
    if process_group is not None:
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=process_group)
    if totals[1] == 0:
        raise EmptyProbeError(
            "the KL probe scored no position (its logits_mask selects nothing on any rank), so the step "
            "cannot be scaled to the KL budget; no weight was changed"
        )
    return float(totals[0] / totals[1])


@torch.no_grad()
def probe_logits(model: nn.Module, batch: ProbeBatch, *, max_tokens: int | None = None,
                 process_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The float32 logits at the positions the probe scores, concatenated over rows (for
    measuring the true KL of an applied update at exactly the predicted positions)."""
    scored_logits = []
    with _eval_mode(model):
        for inputs, scored in _forwards(batch, max_tokens, process_group):
            output = model(**inputs)
            scored_logits.append((output.logits if hasattr(output, "logits") else output)[scored].float())
    return torch.cat(scored_logits)


def measured_probe_kl(before: torch.Tensor, after: torch.Tensor, *, temperature: float,
                      process_group: dist.ProcessGroup | None = None) -> float:
    """Exact KL between two ``probe_logits`` results, averaged over positions (all ranks)."""
    sums = torch.zeros(2, dtype=torch.float64, device=before.device)
    if before.shape[0]:
        sums[0] = measured_kl(before, after, temperature=temperature) * before.shape[0]
        sums[1] = before.shape[0]
    if process_group is not None:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=process_group)
    return float(sums[0] / sums[1]) if sums[1] > 0 else 0.0


def _forwards(batch: ProbeBatch, max_tokens: int | None, process_group: dist.ProcessGroup | None):
    """(inputs, scored) per forward, rows packed by ``ProbeBatch.packed_groups``. Under a
    process group every rank runs as many forwards as the rank that needs the most: a rank
    with fewer repeats its last one, scoring nothing."""
    if batch.rows == 0:
        raise ValueError("the KL probe needs at least one sequence")
    groups = batch.packed_groups(max_tokens)
    forwards = len(groups)
    if process_group is not None:
        count = torch.tensor([forwards], device=batch.input_ids.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=process_group)
        forwards = int(count.item())
    for index in range(forwards):
        inputs, scored = batch.packed_inputs(groups[min(index, len(groups) - 1)], max_tokens)
        yield inputs, (scored if index < len(groups) else torch.zeros_like(scored))


def _tangent_hook(layer: ProbeLayer):
    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        primal, tangent = fwAD.unpack_dual(output)
        # The output's dtype, not the input's: under autocast a float32 input gives a
        # bfloat16 output, and the in-place update below does not autocast.
        dtype = primal.dtype
        inputs = fwAD.unpack_dual(args[0]).primal.to(dtype)
        projected = project(inputs, layer.projection) if layer.shared is None else layer.shared.project(inputs, layer.projection)
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
    """``F.scaled_dot_product_attention`` with a forward-mode derivative: the value from
    the fused kernel, the tangent computed by hand in blocks of ``block`` queries, so a
    (block x keys) score matrix is the largest it makes (``_AttentionWithTangent``).

    Same semantics as SDPA: boolean masks keep True, float masks are added, ``is_causal``
    is aligned top-left, grouped-query attention with ``enable_gqa``; a query that may
    attend to nothing gets a zero output and tangent rather than NaN, so a masked padding
    position cannot poison the tangents of the positions that follow it.
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
        return _AttentionWithTangent.apply(query, key, value, attn_mask, is_causal, scale, enable_gqa, self.block)


class _AttentionWithTangent(torch.autograd.Function):
    """SDPA whose forward-mode tangent is written out: with S = scale * Q K^T (+ mask) and
    P = softmax(S), d(P V) = P dV + (P * dS) V - rowsum(P * dS) * (P V), where
    dS = scale * (dQ K^T + Q dK^T). About twice as fast as letting forward AD trace the
    same blocked computation op by op, and the value keeps the fused kernel."""

    @staticmethod
    def forward(ctx, query, key, value, attn_mask, is_causal, scale, enable_gqa, block):
        output = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, is_causal=is_causal,
                                                scale=scale, enable_gqa=enable_gqa)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            output = torch.where(attn_mask.any(dim=-1, keepdim=True), output, torch.zeros_like(output))
        ctx.save_for_forward(query, key, value, output)
        ctx.attn_mask, ctx.is_causal, ctx.scale, ctx.block = attn_mask, is_causal, scale, block
        return output

    @staticmethod
    def jvp(ctx, query_t, key_t, value_t, *_):
        query, key, value, output = ctx.saved_tensors
        query_t, key_t, value_t = (torch.zeros_like(x) if t is None else t for x, t in ((query, query_t), (key, key_t), (value, value_t)))
        groups = query.shape[-3] // key.shape[-3]
        if groups > 1:
            key, value, key_t, value_t = (x.repeat_interleave(groups, dim=-3) for x in (key, value, key_t, value_t))
        # dS = scale * [Q, dQ] [dK, K]^T: one matmul of twice the depth instead of two and a sum.
        keys_for_score_t = torch.cat([key_t, key], dim=-1).transpose(-2, -1)
        key_transposed = key.transpose(-2, -1)
        attn_mask, scale = ctx.attn_mask, ctx.scale
        blocks = []
        for rows in _chunks(query.shape[-2], ctx.block):
            # Under is_causal, keys after the block's last query are never attended: skip them.
            keys = slice(0, min(rows.stop, key.shape[-2])) if ctx.is_causal else slice(None)
            query_rows = query[..., rows, :] * scale  # scaling the block's queries, not its scores
            scores = query_rows @ key_transposed[..., keys]
            if ctx.is_causal:  # only the keys from the block's first query on can be in the future
                future = torch.ones(rows.stop - rows.start, scores.shape[-1] - rows.start, dtype=torch.bool,
                                    device=query.device).triu_(1)
                scores[..., rows.start:].masked_fill_(future, float("-inf"))
            if attn_mask is not None:
                mask = attn_mask[..., rows, keys] if attn_mask.shape[-2] > 1 else attn_mask[..., keys]
                scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
            weights = torch.softmax(scores, dim=-1)
            if attn_mask is not None and attn_mask.dtype == torch.bool:
                weights = torch.nan_to_num_(weights, nan=0.0)  # a query that sees nothing
            weighted_score_t = (torch.cat([query_rows, query_t[..., rows, :] * scale], dim=-1) @ keys_for_score_t[..., keys]).mul_(weights)
            tangent = weights @ value_t[..., keys, :]
            tangent.add_(weighted_score_t @ value[..., keys, :])
            tangent.sub_(weighted_score_t.sum(dim=-1, keepdim=True) * output[..., rows, :])
            blocks.append(tangent)
        return torch.cat(blocks, dim=-2)


@contextmanager
def _eval_mode(model: nn.Module):
    """Eval mode, every module's train/eval flag restored afterwards, even on error."""
    modes = [(module, module.training) for module in model.modules()]
    try:
        model.eval()
        yield
    finally:
        for module, training in modes:
            module.training = training


@contextmanager
def _probe_mode(model: nn.Module, attention_block: int):
    """Eval mode, no grad, and blocked SDPA attention that supports forward AD; the
    attention implementation is restored afterwards, even on error."""
    config = getattr(model, "config", None)
    attention = getattr(config, "_attn_implementation", None)
    switch = attention not in (None, "eager", "sdpa") and hasattr(model, "set_attn_implementation")
    try:
        if switch:
            model.set_attn_implementation("sdpa")
        with _eval_mode(model), torch.no_grad(), _BlockedAttention(attention_block):
            yield
    finally:
        if switch:
            model.set_attn_implementation(attention)
