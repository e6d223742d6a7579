"""The forward-mode probe: how would the prepared update move the policy's logits?

Every target's output change dY = -(X A^T) D^T is injected as a tangent in one
forward-mode AD pass, so the logits' tangent is the exact Jacobian-vector product of the
whole update; weights are never modified to predict. The Fisher form that turns the
logits' change into a KL is in ``kl.py``; this module is the model machinery: which
positions are scored, attention that forward AD can differentiate, and a head that never
forms full logits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch
import torch.autograd.forward_ad as fwAD
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_logra.core.kl import kl_per_position, measured_kl
from lightning_logra.core.probe_modules import chunks, eval_mode, probe_mode
from lightning_logra.core.projected_input import SharedProjectedInput, project


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
    projection: torch.Tensor  # rank x in_features
    direction: torch.Tensor  # out_features x rank, or the rank's rows of it with gather_rows
    shared: SharedProjectedInput | None = None
    gather_rows: Callable[[torch.Tensor], torch.Tensor] | None = None

    def full_direction(self) -> torch.Tensor:
        return self.direction if self.gather_rows is None else self.gather_rows(self.direction)


@dataclass(frozen=True)
class ProbeBatch:
    """Responses that were already generated, and which logit positions to score.

    ``logits_mask[:, t]`` marks the distribution that generated token t+1 (for completions:
    the completion mask shifted left by one). ``temperature`` is the sampling temperature
    the responses were drawn at. ``position_ids``, when given, are passed to the model.
    ``packed``: each forward lays its rows' real tokens end to end in one row, position ids
    restarting at 0 per row (the given ones when set) and no attention mask, so that the
    model computes no padding (transformers derives each row's mask from the positions).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    logits_mask: torch.Tensor
    position_ids: torch.Tensor | None = None
    temperature: float = 1.0
    packed: bool = False

    @classmethod
    def from_mapping(cls, values: Mapping) -> ProbeBatch:
        """From its dict form (``input_ids``, ``attention_mask``, ``logits_mask``; optional
        ``position_ids``, ``temperature`` and ``packed``)."""
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
            packed=bool(values.get("packed", False)),
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
        longest row when None); with ``packed``, while their tokens do. Short responses then
        run as one batch, which is several times faster than one small forward each, and no
        forward is larger than one row."""
        lengths = [stop - start for start, stop in (self._span(row, max_tokens) for row in range(self.rows))]
        budget = max_tokens if max_tokens is not None else max(lengths)
        groups: list[list[int]] = []
        longest = 0
        for row, length in enumerate(lengths):
            if self.packed:
                fits = bool(groups) and sum(lengths[r] for r in groups[-1]) + length <= budget
            else:
                fits = bool(groups) and (len(groups[-1]) + 1) * max(longest, length) <= budget
            if fits:
                groups[-1].append(row)
                longest = max(longest, length)
            else:
                groups.append([row])
                longest = length
        return groups

    def packed_inputs(self, rows: Sequence[int], max_tokens: int | None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """``row_inputs`` of several rows, right-padded to the longest into one batch
        (padding is masked out and never scored); with ``packed``, end to end in one row."""
        parts = [self.row_inputs(row, max_tokens) for row in rows]
        if self.packed:
            return _packed_row(parts)
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


def _packed_row(parts: list[tuple[dict[str, torch.Tensor], torch.Tensor]]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Single-row inputs laid end to end, each row's positions its own (0-based when not given)."""
    positions = [part.get("position_ids", torch.arange(part["input_ids"].shape[1], device=part["input_ids"].device)
                          .unsqueeze(0)) for part, _ in parts]
    # Without a cache: transformers reads packed positions only when no cache is built.
    inputs = {"input_ids": torch.cat([part["input_ids"] for part, _ in parts], dim=1),
              "position_ids": torch.cat(positions, dim=1), "use_cache": False}
    return inputs, torch.cat([scored for _, scored in parts], dim=1)


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

    def accumulate(logits: torch.Tensor, tangent: torch.Tensor | None) -> None:
        tangent = torch.zeros_like(logits) if tangent is None else tangent
        for chunk in chunks(logits.shape[0], position_chunk):
            totals[0] += kl_per_position(logits[chunk], tangent[chunk], temperature=temperature).sum(dtype=torch.float64)
        totals[1] += logits.shape[0]

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    with probe_mode(model, position_chunk, mlp_chunk), fwAD.dual_level():
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
                    accumulate(*fwAD.unpack_dual((output.logits if hasattr(output, "logits") else output)[scored]))
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
    with eval_mode(model):
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


def _chunked_head_hook(logits_mask: torch.Tensor, position_chunk: int, accumulate):
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
            accumulate(F.linear(selected[chunk], module.weight, module.bias), tangent)
        # One position, as a plain tensor: its logits are never read, and a dual input
        # would copy the weight once more.
        return (fwAD.unpack_dual(hidden[:, :1]).primal,) + tuple(args[1:])

    return hook
