"""The probe's responses: which rows the KL probe scores, how they are packed into
forwards, and what each scored position stands for.

The controller's budget is a mean over every trained position of the update's rows; the
probe scores a few rows. ``reference`` (the authors') probes the first rows.
``stratified`` (ours) sorts the rows by a key (GRPO: the advantage), cuts them into strata
of about equal positions and probes one row drawn from each, weighted so that the weighted
mean over its positions estimates the mean over all of them: a step's KL is concentrated
in a few rows (in the quickstart one row of 32 held up to 61% of it, mostly rows of rare
outcomes, whose advantage is largest), and the first rows of a batch are one prompt's,
often of a group whose advantage is 0 (``benchmarks/results/step_kl_rows.md``).
``weighted`` (ours) cuts the strata by each row's expected share of the KL instead
(positions times ``1 + advantage^2 / mean advantage^2``) and probes a row holding a whole
stratum's share for certain: a rare outcome's row no longer shares a stratum with rows
that barely move, so the step no longer overshoots when the draw misses it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

@dataclass(frozen=True)
class ProbeBatch:
    """Responses that were already generated, and which logit positions to score.

    ``logits_mask[:, t]`` marks the distribution that generated token t+1 (for completions:
    the completion mask shifted left by one). ``temperature`` is the sampling temperature
    the responses were drawn at. ``position_ids``, when given, are passed to the model.
    ``packed``: each forward lays its rows' real tokens end to end in one row, position ids
    restarting at 0 per row (the given ones when set) and no attention mask, so that the
    model computes no padding (transformers derives each row's mask from the positions).
    ``row_keys`` (optional, one per row) is what ``stratified`` sorts rows by (GRPO: their
    advantage); without it rows are stratified in their order. ``row_weights`` (set by
    ``stratified``) is how many of the batch's positions each scored position of a row
    stands for; the probe's means are then weighted by it.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    logits_mask: torch.Tensor
    position_ids: torch.Tensor | None = None
    temperature: float = 1.0
    packed: bool = False
    row_keys: torch.Tensor | None = None
    row_weights: torch.Tensor | None = None

    @classmethod
    def from_mapping(cls, values: Mapping) -> ProbeBatch:
        """From its dict form (``input_ids``, ``attention_mask``, ``logits_mask``; optional
        ``position_ids``, ``temperature``, ``packed`` and ``row_keys``)."""
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
            row_keys=values.get("row_keys"),
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
        """The first ``count`` rows (the authors' probe: ``kl_probe: reference``)."""
        return self._rows(torch.arange(min(count, self.rows), device=self.input_ids.device))

    def stratified(self, count: int, *, max_tokens: int | None, generator: torch.Generator,
                   by_kl_share: bool = False) -> ProbeBatch:
        """At most ``count`` rows, weighted so that their weighted sums over scored positions
        estimate, without bias, the sums over every scored position of the batch: strata of
        equal positions (``kl_probe: stratified``, ``stratified_rows``) or, ``by_kl_share``,
        of equal expected KL (``kl_probe: weighted``, ``share_weighted_rows``). At most
        ``max_tokens`` tokens of a row are probed."""
        probed = [self._scored_count(row, max_tokens) for row in range(self.rows)]
        # Without keys, rows keep their order (a stable sort of zeros) and weigh by tokens alone.
        keys = torch.zeros(self.rows) if self.row_keys is None else self.row_keys
        rule = share_weighted_rows if by_kl_share else stratified_rows
        chosen, weights = rule(self.logits_mask.sum(dim=1), probed, keys, count, generator)
        if not chosen:  # nothing to score anywhere: the probe reports it (EmptyProbeError)
            return self.first_rows(1)
        device = self.input_ids.device
        return replace(self._rows(torch.tensor(chosen, device=device)),
                       row_weights=torch.tensor(weights, dtype=torch.float64, device=device))

    def _rows(self, keep: torch.Tensor) -> ProbeBatch:
        def pick(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor[keep.to(tensor.device)]

        return replace(self, input_ids=self.input_ids[keep], attention_mask=self.attention_mask[keep],
                       logits_mask=self.logits_mask[keep], position_ids=pick(self.position_ids),
                       row_keys=pick(self.row_keys), row_weights=pick(self.row_weights))

    def _scored_count(self, row: int, max_tokens: int | None) -> int:
        start, stop = self._span(row, max_tokens)
        return int(self.logits_mask[row, start:stop].sum()) if stop > start else 0

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

    def packed_weights(self, rows: Sequence[int], max_tokens: int | None) -> torch.Tensor | None:
        """The float64 weight of each position of ``packed_inputs(rows, max_tokens)``'s scored
        mask, laid out like it (0 where nothing is scored); None without ``row_weights``."""
        if self.row_weights is None:
            return None
        parts = [self.row_inputs(row, max_tokens)[1].double() * self.row_weights[row] for row in rows]
        if self.packed:
            return torch.cat(parts, dim=1)
        longest = max(part.shape[1] for part in parts)
        return torch.cat([F.pad(part, (0, longest - part.shape[1])) for part in parts])

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




def stratified_rows(positions: torch.Tensor, usable: Sequence[int], keys: torch.Tensor, count: int,
                    generator: torch.Generator) -> tuple[list[int], list[float]]:
    """One row per stratum, and its weight (``kl_probe: stratified``). Rows with ``usable``
    positions (those a probe can score) are sorted by ``keys`` (stable) and cut into
    ``count`` strata of about equal ``positions``; from each stratum one row is drawn with
    probability proportional to its positions and weighted by the stratum's positions over
    its own usable ones. A value summed over the drawn rows' usable positions, each times
    its row's weight, is then an unbiased estimate of the value's sum over every position of
    the batch, and the weights times the usable positions sum to exactly all positions. The
    variance shrinks as the key sorts rows by their share of the sum. With no more usable
    rows than ``count``, every one is drawn. Empty when no row is usable."""
    positions = positions.detach().cpu().double()
    candidates = _usable_in_key_order(usable, keys)
    if len(candidates) <= count:  # every row fits: each is its own stratum (the exact mean)
        return candidates, _standing_for_themselves(candidates, positions, usable)
    picks = _one_per_stratum(candidates, positions, count, generator)
    return [pick for pick, _ in picks], [total / float(usable[pick]) for pick, total in picks]


def share_weighted_rows(positions: torch.Tensor, usable: Sequence[int], keys: torch.Tensor, count: int,
                        generator: torch.Generator) -> tuple[list[int], list[float]]:
    """Rows and weights with strata of about equal expected share of the step's KL, not of
    positions (``kl_probe: weighted``). A row's expected share is its positions times
    ``1 + key^2 / mean key^2`` (the mean over positions): with the advantage as key, rows
    of rare outcomes, whose own term dominates how far the step moves them, weigh the most
    (in one quickstart update a success among failures moved about 8x as far per position
    as a row of advantage 0; ``benchmarks/results/step_kl_rows.md``). A row holding at least a
    stratum's share is probed for certain, standing for itself (weight positions / usable);
    the rest, in key order, are cut into the remaining strata, one row drawn from each with
    probability proportional to its share and weighted by the stratum's share over its own
    (times positions / usable). The weighted sum over the drawn rows' usable positions is
    an unbiased estimate of the sum over every position, as with ``stratified_rows``, but
    the weights times the usable positions no longer sum to exactly all positions: means
    are ratios of weighted sums. Keys all 0: shares are positions."""
    positions = positions.detach().cpu().double()
    candidates = _usable_in_key_order(usable, keys)
    if len(candidates) <= count:
        return candidates, _standing_for_themselves(candidates, positions, usable)
    squares = keys.detach().cpu().double() ** 2
    mean_square = float((positions[candidates] * squares[candidates]).sum() / positions[candidates].sum())
    shares = positions * (1 + squares / mean_square) if mean_square > 0 else positions.clone()
    certain, rest = [], candidates
    while True:  # each pass may lift another row over the (smaller) remaining strata's share
        slots = count - len(certain)
        threshold = float(shares[rest].sum()) / slots
        heavy = [row for row in rest if float(shares[row]) >= threshold]
        if not heavy:
            break
        certain += heavy
        rest = [row for row in rest if row not in heavy]
    # Every share is positive, so fewer rows than slots can reach the threshold: rest always
    # keeps more rows than the slots left for it.
    picks = _one_per_stratum(rest, shares, count - len(certain), generator)
    chosen = certain + [pick for pick, _ in picks]
    weights = _standing_for_themselves(certain, positions, usable)
    weights += [total / float(shares[pick]) * float(positions[pick]) / float(usable[pick]) for pick, total in picks]
    return chosen, weights


def _standing_for_themselves(rows: list[int], positions: torch.Tensor, usable: Sequence[int]) -> list[float]:
    """Weights of rows probed for certain: each stands for its own positions."""
    return [float(positions[row]) / float(usable[row]) for row in rows]


def _usable_in_key_order(usable: Sequence[int], keys: torch.Tensor) -> list[int]:
    order = torch.argsort(keys.detach().cpu(), stable=True).tolist()
    return [row for row in order if usable[row] > 0]


def _one_per_stratum(rows: list[int], sizes: torch.Tensor, count: int,
                     generator: torch.Generator) -> list[tuple[int, float]]:
    """``rows`` (in order) cut into ``count`` strata of about equal ``sizes``; per stratum
    one row drawn with probability proportional to its size, and the stratum's total size."""
    stratum_sizes = sizes[rows]
    starts = torch.cumsum(stratum_sizes, 0) - stratum_sizes
    strata = (starts * count / stratum_sizes.sum()).floor().long().clamp(max=count - 1).tolist()
    members_of: dict[int, list[int]] = {}
    for row, stratum in zip(rows, strata):
        members_of.setdefault(stratum, []).append(row)
    picks = []
    for stratum in sorted(members_of):
        members = members_of[stratum]
        member_sizes = sizes[members]
        pick = members[int(torch.multinomial(member_sizes, 1, generator=generator))]
        picks.append((pick, float(member_sizes.sum())))
    return picks
