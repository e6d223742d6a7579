"""The forward-mode probe: how would the prepared update move the policy's logits?

Every target's output change dY = -(X A^T) D^T is injected as a tangent in one
forward-mode AD pass, so the logits' tangent is the exact Jacobian-vector product of the
whole update; weights are never modified to predict. The Fisher form that turns the
logits' change into a KL is in ``kl.py``; this module is the model machinery: which
positions are scored, attention that forward AD can differentiate, and a head that never
forms full logits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.autograd.forward_ad as fwAD
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_logra.core.kl import kl_per_position, measured_kl, measured_kl_per_position
from lightning_logra.core.probe_batch import ProbeBatch
from lightning_logra.core.probe_modules import chunks, eval_mode, probe_mode
from lightning_logra.core.projected_input import SharedProjectedInput, linear_input, project
from lightning_logra.core.projection import Projection
from lightning_logra.core.reshard import reshard


class EmptyProbeError(FloatingPointError):
    """The probe scored no position on any rank: there is no prediction to scale the step
    by, and an unscaled step must never be applied in its place. A ``FloatingPointError``
    so that ``on_nonfinite: skip`` skips the step like any other unsafe one."""


@dataclass(frozen=True)
class ProbeLayer:
    """One target as the probe sees it: its module, projection A and direction D, and the
    cache its projection group shares P = X A^T through (``share_projection_by_input``).

    ``direction`` holds every row, or, with ``gather_rows``, this rank's rows only: the full
    D is then gathered when the probe's forward reaches the layer and dropped after it, so
    one layer's full direction exists at a time, as FSDP2 gathers one block's weights."""

    module: nn.Module
    projection: Projection  # A, rank x in_features
    direction: torch.Tensor  # out_features x rank, or the rank's rows of it with gather_rows
    shared: SharedProjectedInput | None = None
    gather_rows: Callable[[torch.Tensor], torch.Tensor] | None = None

    def full_direction(self) -> torch.Tensor:
        return self.direction if self.gather_rows is None else self.gather_rows(self.direction)


def probe_predicted_kl(
    model: nn.Module,
    layers: Sequence[ProbeLayer],
    batch: ProbeBatch,
    *,
    temperature: float | None = None,
    max_tokens: int | None = None,
    position_chunk: int = 128,
    mlp_chunk: int = 512,
    process_group: dist.ProcessGroup | None = None,
) -> float:
    """Predicted KL of the update W -= D A of every layer at once, averaged over the scored
    positions of ``batch`` (at ``temperature``, default the batch's own).

    The probe runs at most one full row's tokens per forward (short rows packed together),
    and SDPA attention in blocks of ``position_chunk`` queries, so neither the batch nor a
    (length x length) score matrix multiplies the memory of forward AD, which keeps a primal and a tangent of every
    activation; position-wise MLPs run ``mlp_chunk`` tokens at a time (``probe_modules``).
    Full-vocabulary logits exist for ``position_chunk`` positions at a time
    when the model exposes its output head (``get_output_embeddings``). With a
    ``process_group`` the sum and count are all-reduced over it and every rank returns the
    global mean; ranks then run the same number of forwards (sharded models gather weights
    in each). ``None`` probes locally. No scored position anywhere is an ``EmptyProbeError``.
    """
    temperature = batch.temperature if temperature is None else temperature
    totals = torch.zeros(2, dtype=torch.float64, device=batch.input_ids.device)  # (sum of KL, positions)

    def accumulate(logits: torch.Tensor, tangent: torch.Tensor | None, weights: torch.Tensor | None) -> None:
        tangent = torch.zeros_like(logits) if tangent is None else tangent
        for chunk in chunks(logits.shape[0], position_chunk):
            kl = kl_per_position(logits[chunk], tangent[chunk], temperature=temperature)
            totals[0] += kl.sum(dtype=torch.float64) if weights is None else (kl.double() * weights[chunk]).sum()
        totals[1] += logits.shape[0] if weights is None else weights.sum()

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    with probe_mode(model, position_chunk, mlp_chunk), fwAD.dual_level():
        handles = [layer.module.register_forward_hook(_tangent_hook(layer), with_kwargs=True) for layer in layers]
        try:
            for inputs, scored, weights in _forwards(batch, max_tokens, process_group):
                weights = None if weights is None else weights[scored]
                if isinstance(head, nn.Linear):
                    head_hook = head.register_forward_pre_hook(_chunked_head_hook(scored, weights, position_chunk, accumulate))
                    try:
                        model(**inputs)
                    finally:
                        head_hook.remove()
                else:
                    output = model(**inputs)
                    accumulate(*fwAD.unpack_dual((output.logits if hasattr(output, "logits") else output)[scored]), weights)
        finally:
            for handle in handles:
                handle.remove()
            reshard(model)
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
                 process_group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The float32 logits at the positions the probe scores, concatenated over rows, and
    their weights (None without ``row_weights``): for measuring the true KL of an applied
    update at exactly the predicted positions."""
    scored_logits, scored_weights = [], []
    with eval_mode(model):
        for inputs, scored, weights in _forwards(batch, max_tokens, process_group):
            output = model(**inputs)
            scored_logits.append((output.logits if hasattr(output, "logits") else output)[scored].float())
            if weights is not None:
                scored_weights.append(weights[scored])
    reshard(model)
    return torch.cat(scored_logits), torch.cat(scored_weights) if scored_weights else None


def measured_probe_kl(before: torch.Tensor, after: torch.Tensor, *, temperature: float,
                      weights: torch.Tensor | None = None, process_group: dist.ProcessGroup | None = None) -> float:
    """Exact KL between two ``probe_logits`` results, averaged over positions (weighted by
    ``weights`` when given) over all ranks."""
    sums = torch.zeros(2, dtype=torch.float64, device=before.device)
    if before.shape[0] and weights is not None:
        sums[0] = (measured_kl_per_position(before, after, temperature=temperature) * weights).sum()
        sums[1] = weights.sum()
    elif before.shape[0]:
        sums[0] = measured_kl(before, after, temperature=temperature) * before.shape[0]
        sums[1] = before.shape[0]
    if process_group is not None:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=process_group)
    return float(sums[0] / sums[1]) if sums[1] > 0 else 0.0


def _forwards(batch: ProbeBatch, max_tokens: int | None, process_group: dist.ProcessGroup | None):
    """(inputs, scored, weights) per forward, rows packed by ``ProbeBatch.packed_groups``
    (``weights``: ``ProbeBatch.packed_weights``, None without row weights). Under a
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
        rows = groups[min(index, len(groups) - 1)]
        inputs, scored = batch.packed_inputs(rows, max_tokens)
        if index >= len(groups):
            scored = torch.zeros_like(scored)
        yield inputs, scored, batch.packed_weights(rows, max_tokens)


def _tangent_hook(layer: ProbeLayer):
    def hook(module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor:
        primal, tangent = fwAD.unpack_dual(output)
        # The output's dtype, not the input's: under autocast a float32 input gives a
        # bfloat16 output, and the in-place update below does not autocast.
        dtype = primal.dtype
        inputs = fwAD.unpack_dual(linear_input(args, kwargs)).primal.to(dtype)
        projected = (project(inputs, layer.projection.matrix()) if layer.shared is None
                     else layer.shared.project(inputs, layer.projection))
        direction = layer.full_direction().to(dtype)
        if tangent is None:
            return fwAD.make_dual(primal, (projected @ direction.T).neg_().view_as(primal))
        if not tangent.is_contiguous():
            return fwAD.make_dual(primal, tangent - (projected @ direction.T).view_as(primal))
        # The layer's own tangent is a fresh tensor: add -(X A^T) D^T into it in place
        # rather than holding a second (tokens x out_features) temporary.
        tangent.view(-1, tangent.shape[-1]).addmm_(projected, direction.T, alpha=-1)
        return fwAD.make_dual(primal, tangent)

    return hook


def _chunked_head_hook(logits_mask: torch.Tensor, weights: torch.Tensor | None, position_chunk: int, accumulate):
    """Score the selected positions in chunks inside the head's own forward, then let the
    head compute a single position: the full (batch x length x vocab) logits never exist.

    The head is linear and no target, so its tangent is the head applied to the hidden
    state's tangent: both are computed as plain GEMMs. (Forward AD through ``F.linear``
    copied the transposed vocabulary weight for every chunk: 2.6 s of a 14.9 s probe over
    2 x 2,048 tokens with a 32k x 1,024 head.)"""

    def hook(module: nn.Linear, args: tuple) -> tuple:
        hidden = args[0]
        selected, selected_tangent = fwAD.unpack_dual(hidden[logits_mask])
        for chunk in chunks(selected.shape[0], position_chunk):
            tangent = None if selected_tangent is None else F.linear(selected_tangent[chunk], module.weight)
            accumulate(F.linear(selected[chunk], module.weight, module.bias), tangent,
                       None if weights is None else weights[chunk])
        # One position, as a plain tensor: its logits are never read, and a dual input
        # would copy the weight once more.
        return (fwAD.unpack_dual(hidden[:, :1]).primal,) + tuple(args[1:])

    return hook
