"""LoGRAOptimizer: the whole LoGRA update in one call.

    optimizer.zero_grad()
    loss.backward()                                   # sketch hooks accumulate S = G A^T
    report = optimizer.step(logra_inputs=LoGRAStepInputs(probe=ProbeBatch(...)))  # -> StepReport

``step`` reads like the spec: reduce the sketches and compute the RowAdam directions
scaled to update_ratio (``prepare_update``), ask the KL controller for a budget, probe
the predicted KL, scale, apply W -= alpha * D A row-chunk by row-chunk, redraw A
(``apply_update``). A non-finite value anywhere skips the step on every rank together
(``on_nonfinite: skip``) or raises. Target weights may be plain tensors or FSDP2 DTensors
sharded on dim 0; each rank then updates only its own rows.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_logra.core.config import AUTO_RANK, LoGRAConfig
from lightning_logra.core.kl import Budget, KLController, mismatch_sums
from lightning_logra.core.layout import RowLayout, make_layout
from lightning_logra.core.lowrank import LowRankUpdate, low_rank_updates, scaled_factor
from lightning_logra.core.probe import (
    ProbeBatch,
    ProbeLayer,
    measured_probe_kl,
    probe_logits,
    probe_predicted_kl,
)
from lightning_logra.core.projected_input import SharedProjectedInput
from lightning_logra.core.projection import projection_seed
from lightning_logra.core.reliability import memory_phase
from lightning_logra.core.report import StepReport
from lightning_logra.core.row_adam import row_adam_directions
from lightning_logra.core.sketch import SketchSet, install_sketches
from lightning_logra.core.step_inputs import LoGRAStepInputs
from lightning_logra.core.validation import warn_renamed
from lightning_logra.core.update import (
    PreparedUpdate,
    apply_directions,
    local_rows,
    update_square_norm,
)

# What shrinks each phase's memory, for the error an out-of-memory in it raises.
UPDATE_HINT = "logra.update_chunk_rows (rows updated at a time), logra.rank"
PROBE_HINT = "logra.probe_responses, logra.probe_max_tokens, logra.probe_chunk_positions, logra.probe_mlp_chunk_tokens"


class LoGRAOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` over the target weights of ``model``.

    Constructing it installs the sketches and, as in the paper, freezes every non-target
    parameter (``freeze_non_targets=False`` leaves them to another optimizer). The single
    param group's ``lr`` is the update ratio. State (row moments, counters, the KL
    controller's mismatch EMA) is saved by ``state_dict`` as tensors only. The optimizer
    keeps its own copy of ``config``, the caller's is never changed: a ``rank`` of
    ``"auto"`` is resolved in the copy against the model's targets, so ``self.config.rank``
    (and the configuration checkpoints hold) is the int in use.
    """

    def __init__(
        self,
        model: nn.Module,
        config: LoGRAConfig | None = None,
        *,
        compute_dtype: torch.dtype | None = None,
        freeze_non_targets: bool = True,
    ) -> None:
        config = config or LoGRAConfig()
        sketches = install_sketches(model, config, compute_dtype=compute_dtype)
        # A copy, so one config can serve several models; with rank "auto" resolved, the
        # int in use is what state_dict() stores and check_state() compares (a structural field).
        config = dataclasses.replace(config, rank=sketches.rank if config.rank == AUTO_RANK else config.rank,
                                     target_modules=list(config.target_modules))
        if freeze_non_targets:
            for parameter in model.parameters():
                parameter.requires_grad_(False)
        super().__init__([state.weight for state in sketches], {"lr": config.update_ratio})
        self.model = model
        self.config = config
        self.sketches: SketchSet = sketches
        self.controller = KLController(config)
        self.layout: RowLayout = make_layout(config.sketch_reduction, sketches, config.sketch_accumulation)
        for state, moment in zip(sketches, self.layout.local_moments()):
            state.second_moment = moment
        self.update_count = 0
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self._prepared: PreparedUpdate | None = None
        self._coverage_checked = False

    @property
    def mismatch(self) -> float:
        return self.controller.mismatch

    def state_bytes(self) -> dict[str, int]:
        """Bytes of LoGRA's state on this rank, by part, as allocated now (``memory_report``
        predicts the same from shapes alone): the sketch accumulator, the scratch slots of
        sharded accumulation, the distinct projections, the RowAdam row moments, and their
        ``total``."""
        parts = {
            "sketch_accumulator": self.sketches.buffer.nbytes,
            "accumulation_scratch": 0 if self.sketches.accumulator is None else self.sketches.accumulator.scratch_bytes,
            "projections": sum(projection.nbytes for _, projection in self.sketches.projections()),
            "second_moments": sum(state.second_moment.nbytes for state in self.sketches),
        }
        return {**parts, "total": sum(parts.values())}

    # ----------------------------------------------------------------------------- one step
    def step(
        self,
        closure: Callable[[], Any] | None = None,
        *,
        logra_inputs: LoGRAStepInputs | None = None,
        process_group: dist.ProcessGroup | None = None,
        measure_kl: bool = False,
        allow_no_backward: bool = False,
        **deprecated_inputs: Any,
    ) -> StepReport | None:
        """One LoGRA update: prepare -> budget -> probe -> scale -> apply -> redraw.

        ``logra_inputs`` (``LoGRAStepInputs``): the probe responses (``probe_responses``
        of them are probed, chosen by ``kl_probe``; needed unless ``kl_control`` is off), the
        rollout/trainer log-prob pairs of the mismatch term, the global count of loss-bearing
        tokens when the loss is a sum over tokens, and whether to record the applied update
        as (alpha D, seed of A) per target for a low-rank weight sync (a collective when
        sharded). ``process_group``: the data-parallel group (default: the whole world when
        torch.distributed is initialised). With ``measure_kl`` the true KL of the applied
        update on the probe is reported too. With ``allow_no_backward``, a step where no rank
        ran backward returns None and changes nothing (Lightning skips a step whose
        training_step returned None). The inputs' fields as keywords (``probe=...``) are
        deprecated: they warn once and mean the same.
        """
        inputs = _step_inputs(logra_inputs, deprecated_inputs)
        if closure is not None:
            with torch.enable_grad():
                closure()
        group = _data_group(process_group)
        calls = self.backward_calls(group)
        if allow_no_backward and not calls.any():
            self.skip_update()
            return None
        config = self.config
        probe = _probe_batch(inputs.probe, config, self._probe_generator(group))
        timings = {"prepare_s": 0.0, "probe_s": 0.0, "apply_s": 0.0}
        budget = prediction = alpha = measured = None
        try:
            with _timed(timings, "prepare_s"), memory_phase("update", UPDATE_HINT):
                prepared = self.prepare_update(normalization_tokens=inputs.normalization_tokens, process_group=group,
                                               backward_calls=calls)
            with _timed(timings, "probe_s"), memory_phase("probe", PROBE_HINT):
                if probe is not None:
                    pairs = None if inputs.logprob_pairs is None else mismatch_sums(*inputs.logprob_pairs)
                    budget = self.controller.budget(self.update_count, pairs, group)
                    prediction = self.predict_kl(probe, group)
                    alpha = self.controller.scale(prediction, budget)
                    before, weights = probe_logits(self.model, probe, max_tokens=config.probe_max_tokens,
                                                   process_group=group) if measure_kl else (None, None)
                else:
                    alpha = 1.0
            with _timed(timings, "apply_s"), memory_phase("update", UPDATE_HINT):
                low_rank = self.apply_update(alpha=alpha, budget=budget, record_low_rank=inputs.record_low_rank)
            if measure_kl and probe is not None:
                after, _ = probe_logits(self.model, probe, max_tokens=config.probe_max_tokens, process_group=group)
                measured = measured_probe_kl(before, after, temperature=self._temperature(probe), weights=weights,
                                             process_group=group)
        except FloatingPointError as error:
            # Sketch flags, the probe and alpha are reduced across ranks, so every rank
            # lands here together and stays consistent.
            if config.on_nonfinite == "raise":
                self.skip_update()
                raise
            return self._skip(error, timings)
        self.consecutive_skips = 0
        return StepReport(
            update=self.update_count - 1, skipped=False, skip_reason=None, skipped_steps=self.skipped_steps,
            alpha=alpha, predicted_kl=prediction,
            predicted_kl_scaled=None if prediction is None else alpha**2 * prediction,
            budget=None if budget is None else budget.effective, mismatch=self.controller.mismatch,
            mismatch_nonfinite_pairs=0 if budget is None else budget.nonfinite_pairs, measured_kl=measured, sketch_norm=prepared.sketch_norm, weight_norm=prepared.weight_norm,
            update_norm=prepared.update_norm, update_ratio=self.param_groups[0]["lr"], **timings,
            low_rank_updates=low_rank,
        )

    # ----------------------------------------------------------------------------- the pieces
    @torch.no_grad()
    def prepare_update(
        self,
        *,
        normalization_tokens: float | torch.Tensor,
        process_group: dist.ProcessGroup | None = None,
        backward_calls: torch.Tensor | None = None,
    ) -> PreparedUpdate:
        """Reduce the sketches over data-parallel ranks, divide by the global count of
        loss-bearing tokens, and compute the RowAdam directions scaled so that the whole
        update has norm lr * ||W||. Nothing is applied and no state changes until
        apply_update(). ``backward_calls``: this step's already reduced counts, if known."""
        if self._prepared is not None:
            raise RuntimeError("an update is already prepared: apply_update() or skip_update() it before preparing another")
        tokens = float(normalization_tokens)
        if not math.isfinite(tokens) or tokens <= 0:
            raise ValueError(f"normalization_tokens must be a finite count > 0, got {tokens}")
        group = _data_group(process_group)
        self._check_backward_reached(self.backward_calls(group) if backward_calls is None else backward_calls)

        # The sketches are spent once an update is prepared, whether it is then applied or
        # skipped: the reduction and RowAdam run in place in them.
        normalized = self.layout.reduce(tokens, group)
        moments = [state.second_moment.clone() for state in self.sketches]
        directions = row_adam_directions(
            normalized,
            moments,
            step=self.update_count + 1,
            beta2=self.config.beta2,
            epsilon=self.config.epsilon,
            names=[state.name for state in self.sketches],
            row_group=self.layout.row_group,
            inplace=True,  # the spent sketches become the directions: no second d x r buffer
        )
        directions = self.layout.own_rows(directions)

        squares = torch.zeros(3, dtype=torch.float64, device=self.sketches.buffer.device)
        for state, direction in zip(self.sketches, directions):
            # float64 accumulation without a float64 copy of the weight
            squares[0] += torch.linalg.vector_norm(direction, dtype=torch.float64).square()  # = ||S_hat|| per layer
            squares[1] += torch.linalg.vector_norm(local_rows(state.weight), dim=1).double().square().sum()
            squares[2] += update_square_norm(direction, state.projection)
        self.layout.sum_over_shards(squares)
        sketch_square, weight_square, update_square = squares.tolist()
        ratio = self.param_groups[0]["lr"]
        factor = ratio * math.sqrt(weight_square / update_square) if update_square > 0 else 0.0
        for direction in directions:
            direction.mul_(factor)
        self._prepared = PreparedUpdate(
            directions=directions,
            moments=moments,
            sketch_norm=math.sqrt(sketch_square),
            weight_norm=math.sqrt(weight_square),
            update_norm=factor * math.sqrt(update_square),
        )
        return self._prepared

    def predict_kl(self, probe: ProbeBatch, process_group: dist.ProcessGroup | None = None) -> float:
        """Predicted KL of the prepared (unscaled) update on ``probe``, averaged over the
        scored positions of every rank in the group."""
        config = self.config
        return probe_predicted_kl(
            self.model, self.probe_layers(), probe,
            temperature=self._temperature(probe), max_tokens=config.probe_max_tokens,
            position_chunk=config.probe_chunk_positions, mlp_chunk=config.probe_mlp_chunk_tokens,
            process_group=process_group,
        )

    @torch.no_grad()
    def apply_update(
        self, *, alpha: float = 1.0, budget: Budget | None = None, record_low_rank: bool = False
    ) -> tuple[LowRankUpdate, ...] | None:
        """Apply W -= alpha * D A to the local weight rows, ``update_chunk_rows`` rows at a time;
        then commit the moments (and the controller's mismatch EMA with ``budget``), count
        the update, redraw the projections and zero the sketches. With ``record_low_rank``,
        return the update as (alpha D, seed of A) per target (``lowrank.py``)."""
        if self._prepared is None:
            raise RuntimeError("apply_update() needs prepare_update() first: no update is prepared")
        alpha = float(alpha)
        if not math.isfinite(alpha) or alpha < 0:
            raise FloatingPointError(f"step scale alpha must be finite and >= 0, got {alpha}; no weight was changed")
        low_rank = tuple(self._low_rank_updates(alpha)) if record_low_rank else None
        apply_directions(self.sketches, self._prepared.directions, self.layout.rows, alpha, self.config)
        for state, moment in zip(self.sketches, self._prepared.moments):
            state.second_moment.copy_(moment)
        if budget is not None:
            self.controller.commit(budget)
        self.update_count += 1
        self._finish_step()
        return low_rank

    def _low_rank_updates(self, alpha: float) -> list[LowRankUpdate]:
        factors = [scaled_factor(direction, alpha, self.config, local_rows(state.weight).dtype)
                   for direction, state in zip(self._prepared.directions, self.sketches)]
        return low_rank_updates(self.sketches, self.layout.full_rows(factors), self.config, self.update_count)

    def skip_update(self) -> None:
        """Drop the prepared update and this step's sketches without touching any weight,
        moment or counter: every rank that calls it stays consistent with the others."""
        self._prepared = None
        self.sketches.zero_()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.sketches.zero_()
        self._prepared = None
        super().zero_grad(set_to_none=set_to_none)

    @property
    def prepared(self) -> PreparedUpdate | None:
        return self._prepared

    def probe_layers(self) -> list[ProbeLayer]:
        """The prepared update as the KL probe needs it, per layer: the directions, which
        the probe gathers from the owning ranks layer by layer when rows are sharded."""
        if self._prepared is None:
            raise RuntimeError("no update is prepared: call prepare_update() before probing it")
        # A projection group shares P = X A^T in the probe too, through a cache of its own.
        probe_caches: dict[int, SharedProjectedInput] = {}
        return [
            ProbeLayer(module=state.module, projection=state.source, direction=direction, gather_rows=gather,
                       shared=None if state.shared_input is None else probe_caches.setdefault(
                           id(state.shared_input), SharedProjectedInput(state.shared_input.members)))
            for state, direction, gather in zip(self.sketches, self._prepared.directions, self.layout.row_gatherers())
        ]

    def backward_calls(self, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """Backward passes that reached each target since the last step over ``group``
        (summed; the most any rank ran, with sharded accumulation, which needs them equal)."""
        calls = torch.tensor([state.backward_calls for state in self.sketches], dtype=torch.float64, device=self.sketches.buffer.device)
        return self.layout.backward_calls(calls, group)

    # ----------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Tensors only (the configuration and layer names as UTF-8 JSON bytes), so that
        ``torch.load(..., weights_only=True)`` and DCP load it without unpickling code."""
        return {
            "config": _json_tensor(self.config.to_dict()),
            "layers": _json_tensor([state.name for state in self.sketches]),
            "update_count": torch.tensor([self.update_count], dtype=torch.int64),
            "skipped_steps": torch.tensor([self.skipped_steps], dtype=torch.int64),
            "mismatch": torch.tensor([self.controller.mismatch], dtype=torch.float64),
            "lr": torch.tensor([self.param_groups[0]["lr"]], dtype=torch.float64),
            "second_moments": {state.name: self.layout.moment_to_save(state) for state in self.sketches},
        }

    def check_state(self, state_dict: dict[str, Any]) -> list[str]:
        """Raise ``ValueError`` if ``state_dict`` cannot be resumed (another structural
        configuration, other target layers, not a LoGRA state); return the non-structural
        changes as ``"field: old -> new"``. Nothing is loaded."""
        missing = {"config", "layers", "update_count", "skipped_steps", "mismatch", "lr", "second_moments"} - set(state_dict)
        if missing:
            raise ValueError(f"not a LoGRA optimizer state: missing {sorted(missing)}")
        saved = _from_json_tensor(state_dict["config"])
        mismatches = self.config.structural_mismatches(saved)
        if mismatches:
            raise ValueError("checkpoint was written with another LoGRA configuration: " + "; ".join(mismatches))
        layers = _from_json_tensor(state_dict["layers"])
        names = [state.name for state in self.sketches]
        if layers != names:
            raise ValueError(
                f"checkpoint targets {len(layers)} layers that differ from this model's {len(names)}: "
                f"first difference at {_first_difference(layers, names)}"
            )
        mismatch = float(state_dict["mismatch"].item())
        if not math.isfinite(mismatch):
            raise ValueError(f"the mismatch EMA in the checkpoint is {mismatch}, not finite: the checkpoint is corrupt "
                             "(resuming from it would pin every later budget to its floor)")
        return self.config.tuning_changes(saved)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore moments, counters and the mismatch EMA; re-derive the projections.
        Resuming with other tuning fields (kl_budget, update_ratio, ...) is allowed and
        warns, listing each changed field with its old and new value."""
        changes = self.check_state(state_dict)
        moments = []
        for state in self.sketches:
            moment = state_dict["second_moments"][state.name]
            moment = moment.to_local() if hasattr(moment, "to_local") else moment
            if moment.shape != state.second_moment.shape:
                raise ValueError(f"second moment of {state.name}: shape {tuple(moment.shape)} != {tuple(state.second_moment.shape)}")
            if not torch.isfinite(moment).all():
                raise ValueError(f"second moment of {state.name} in the checkpoint is not finite")
            moments.append(moment)
        if changes:
            warnings.warn("resuming LoGRA with changed settings: " + "; ".join(changes), stacklevel=2)
        for state, moment in zip(self.sketches, moments):
            state.second_moment.copy_(moment)
        self.update_count = int(state_dict["update_count"].item())
        self.skipped_steps = int(state_dict["skipped_steps"].item())
        self.controller.mismatch = float(state_dict["mismatch"].item())
        if not any(change.startswith("update_ratio:") for change in changes):  # else the new ratio holds
            self.param_groups[0]["lr"] = float(state_dict["lr"].item())
        self._finish_step()

    # ----------------------------------------------------------------------------- helpers
    def _probe_generator(self, group: dist.ProcessGroup | None) -> torch.Generator:
        """The stratified probe's row draws: a function of (seed, update, rank), so that a
        resumed run draws what the uninterrupted one did and ranks draw independently."""
        rank = dist.get_rank(group) if group is not None else 0
        return torch.Generator().manual_seed(((self.config.seed * 1_000_003 + self.update_count) * 65_537 + rank) % 2**63)

    def _temperature(self, probe: ProbeBatch) -> float:
        """An explicit logra.probe_temperature wins; else the probe's sampling temperature."""
        return self.config.probe_temperature if self.config.probe_temperature is not None else probe.temperature

    def _skip(self, error: FloatingPointError, timings: dict[str, float]) -> StepReport:
        """No weight changes; too many skips in a row stop the run."""
        self.skip_update()
        self.skipped_steps += 1
        self.consecutive_skips += 1
        if self.consecutive_skips >= self.config.max_consecutive_skips:
            raise FloatingPointError(
                f"LoGRA skipped {self.consecutive_skips} consecutive steps "
                f"(max_consecutive_skips={self.config.max_consecutive_skips}); last: {error}"
            ) from error
        warnings.warn(f"LoGRA skipped a step ({self.skipped_steps} so far, no weight changed): {error}", stacklevel=3)
        return StepReport(
            update=self.update_count, skipped=True, skip_reason=str(error), skipped_steps=self.skipped_steps,
            alpha=None, predicted_kl=None, predicted_kl_scaled=None, budget=None, mismatch=self.controller.mismatch,
            mismatch_nonfinite_pairs=0, measured_kl=None, sketch_norm=None, weight_norm=None, update_norm=None,
            update_ratio=self.param_groups[0]["lr"], **timings,
        )

    def _finish_step(self) -> None:
        self._prepared = None
        self.sketches.zero_()
        self._redraw()

    def _redraw(self) -> None:
        """Each distinct A in place from its seed name (a shared A once, for its group)."""
        update = self.update_count if self.config.redraw_projections else 0
        for name, projection in self.sketches.projections():
            projection.redraw(projection_seed(self.config.seed, update, name))

    def _check_backward_reached(self, calls: torch.Tensor) -> None:
        if not calls.any():
            raise RuntimeError(
                "prepare_update() found no backward pass since the last step or zero_grad(): "
                "run backward (manual_backward) on a loss before stepping"
            )
        if not self._coverage_checked:
            unreached = [state.name for state, count in zip(self.sketches, calls.tolist()) if count == 0]
            if unreached:
                raise RuntimeError(
                    f"LoGRA targets never ran as modules in forward/backward, so their sketches stay zero: "
                    f"{', '.join(unreached[:5])}{' ...' if len(unreached) > 5 else ''}. Their parent probably uses "
                    "the weight functionally (e.g. nn.MultiheadAttention.out_proj); remove them from target_modules"
                )
            self._coverage_checked = True


def _probe_batch(probe: ProbeBatch | dict | None, config: LoGRAConfig, generator: torch.Generator) -> ProbeBatch | None:
    if not config.kl_control:
        return None
    if probe is None:
        raise ValueError(
            "LoGRA's KL control needs probe responses: pass step(logra_inputs=LoGRAStepInputs(probe=ProbeBatch(...))) "
            "(the same keyword through Lightning's and Fabric's optimizers; a Trainer run may instead train on dict "
            "batches with 'input_ids', which are probed by default), or set logra.kl_control=false to step unscaled"
        )
    probe = ProbeBatch.from_mapping(probe)
    if config.kl_probe == "reference":
        return probe.first_rows(config.probe_rows())
    return probe.stratified(config.probe_rows(), max_tokens=config.probe_max_tokens, generator=generator,
                            by_kl_share=config.kl_probe == "weighted")


def _step_inputs(inputs: LoGRAStepInputs | None, deprecated: dict[str, Any]) -> LoGRAStepInputs:
    """``inputs``, or one built from the deprecated keywords (its fields by name)."""
    fields = {field.name for field in dataclasses.fields(LoGRAStepInputs)}
    unknown = sorted(set(deprecated) - fields)
    if unknown:
        raise TypeError(f"LoGRAOptimizer.step() got unexpected keyword arguments {unknown}")
    if not deprecated:
        return LoGRAStepInputs() if inputs is None else inputs
    if inputs is not None:
        raise TypeError(f"LoGRAOptimizer.step() takes logra_inputs or its fields {sorted(deprecated)}, not both")
    for name in deprecated:
        warn_renamed("LoGRAOptimizer", f"step({name}=...)", f"step(logra_inputs=LoGRAStepInputs({name}=...))",
                     stacklevel=4)  # through torch.optim's step wrapper
    return LoGRAStepInputs(**deprecated)


def _data_group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """``process_group``, else the whole world when torch.distributed is initialised."""
    if process_group is not None:
        return process_group
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


@contextmanager
def _timed(timings: dict[str, float], key: str) -> Iterator[None]:
    """Wall-clock seconds into ``timings[key]``, and a profiler range ``logra.<phase>``
    (``logra.prepare``, ``logra.probe``, ``logra.apply``) for memory and time ledgers."""
    started = time.perf_counter()
    try:
        with torch.profiler.record_function("logra." + key.removesuffix("_s")):
            yield
    finally:
        timings[key] += time.perf_counter() - started


def _json_tensor(value: Any) -> torch.Tensor:
    return torch.tensor(list(json.dumps(value, sort_keys=True).encode("utf-8")), dtype=torch.uint8)


def _from_json_tensor(tensor: torch.Tensor) -> Any:
    return json.loads(bytes(tensor.to(torch.uint8).tolist()).decode("utf-8"))


def _first_difference(saved: list[str], current: list[str]) -> str:
    for index, (a, b) in enumerate(zip(saved, current)):
        if a != b:
            return f"#{index}: {a!r} vs {b!r}"
    return f"#{min(len(saved), len(current))} (lengths {len(saved)} vs {len(current)})"
