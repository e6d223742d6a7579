"""LoGRAOptimizer: sketches in, RowAdam directions, scaled row-chunked updates out.

One optimizer step is two calls, so that the KL controller can look at the update before
it lands:

    optimizer.prepare_update(normalization_tokens=N)  # reduce sketches, RowAdam, norm
    alpha = ...                                        # KL controller (kl.py)
    optimizer.step(alpha=alpha)                        # W -= alpha * D A, redraw A, zero S

Target weights may be plain tensors or FSDP2 DTensors sharded on dim 0; each rank then
updates only its own rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_logra.config import LoGRAConfig
from lightning_logra.kl import ProbeLayer
from lightning_logra.projection import make_projection, projection_seed
from lightning_logra.row_adam import row_adam_directions
from lightning_logra.sketch import SketchSet, install_sketches, local_row_range


@dataclass(frozen=True)
class PreparedUpdate:
    """What prepare_update computed; directions are already scaled to update_ratio. They
    occupy the spent sketch buffers, so they are valid until step() or skip_update()."""

    directions: list[torch.Tensor]  # local rows x rank, float32, per layer
    moments: list[torch.Tensor]  # RowAdam second moments after this step, committed by step()
    sketch_norm: float  # ||S_hat||_F over all layers
    weight_norm: float  # ||W||_F over all target weights
    update_norm: float  # ||D A||_F over all layers (= update_ratio * weight_norm)


class LoGRAOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` over the target weights of ``model``.

    Constructing it installs the sketches and, as in the paper, freezes every non-target
    parameter (``freeze_non_targets=False`` leaves them to another optimizer). The single
    param group's ``lr`` is the update ratio, so learning-rate schedulers scale it.
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
        if freeze_non_targets:
            for parameter in model.parameters():
                parameter.requires_grad_(False)
        super().__init__([state.weight for state in sketches], {"lr": config.update_ratio})
        self.model = model
        self.config = config
        self.sketches: SketchSet = sketches
        self.update_count = 0
        self.mismatch = 0.0
        self._rows = [local_row_range(state.weight) for state in sketches]
        self._weight_group = _weight_group(sketches)
        world = dist.get_world_size(self._weight_group) if self._weight_group is not None else 1
        self.reduction = _resolve_reduction(config.sketch_reduction, world, self._weight_group is not None)
        if self.reduction == "reduce_scatter":
            for state, (start, stop) in zip(sketches, self._rows):
                state.second_moment = state.second_moment[start:stop].clone()
        self._prepared: PreparedUpdate | None = None
        self._coverage_checked = False

    # ----------------------------------------------------------------------------- step 1
    @torch.no_grad()
    def prepare_update(
        self,
        *,
        normalization_tokens: float | torch.Tensor,
        process_group: dist.ProcessGroup | None = None,
    ) -> PreparedUpdate:
        """Reduce the sketches over data-parallel ranks, divide by the global count of
        loss-bearing tokens, and compute the RowAdam directions scaled so that the whole
        update has norm lr * ||W||. Nothing is applied and no state changes until step()."""
        if self._prepared is not None:
            raise RuntimeError("an update is already prepared: step() or skip_update() it before preparing another")
        tokens = float(normalization_tokens)
        if not math.isfinite(tokens) or tokens <= 0:
            raise ValueError(f"normalization_tokens must be a finite count > 0, got {tokens}")
        distributed = dist.is_available() and dist.is_initialized()
        group = process_group if process_group is not None else (dist.group.WORLD if distributed else None)
        self._check_backward_reached(group if distributed else None)

        # S_hat = (sum over ranks / world) / N, divided in place: the sketches are spent
        # once an update is prepared, whether it is then applied or skipped.
        if self.reduction == "reduce_scatter":
            normalized = [sketch.div_(tokens) for sketch in self._reduce_scatter(self._weight_group)]
        else:
            world = dist.get_world_size(group) if distributed else 1
            if world > 1:
                dist.all_reduce(self.sketches.buffer, op=dist.ReduceOp.SUM, group=group)
            self.sketches.buffer.div_(world * tokens)
            normalized = [state.sketch for state in self.sketches]

        moments = [state.second_moment.clone() for state in self.sketches]
        directions = row_adam_directions(
            normalized,
            moments,
            step=self.update_count + 1,
            beta2=self.config.beta2,
            epsilon=self.config.epsilon,
            names=[state.name for state in self.sketches],
            row_group=self._weight_group if self.reduction == "reduce_scatter" else None,
            inplace=True,  # the spent sketches become the directions: no second d x r buffer
        )
        if self.reduction == "all_reduce" and self._weight_group is not None:
            # Replicated RowAdam, row-sharded weights: keep only the rows this rank updates.
            directions = [d[start:stop].clone() for d, (start, stop) in zip(directions, self._rows)]

        squares = torch.zeros(3, dtype=torch.float64, device=self.sketches.buffer.device)
        for state, direction in zip(self.sketches, directions):
            # float64 accumulation without a float64 copy of the weight
            squares[0] += torch.linalg.vector_norm(direction, dtype=torch.float64).square()  # = ||S_hat|| per layer
            squares[1] += torch.linalg.vector_norm(_local(state.weight), dim=1).double().square().sum()
            squares[2] += _update_square_norm(direction, state.projection)
        if self._weight_group is not None:
            dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=self._weight_group)
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

    # ----------------------------------------------------------------------------- step 2
    @torch.no_grad()
    def step(self, closure: Any = None, *, alpha: float = 1.0) -> Any:
        """Apply W -= alpha * D A to the local weight rows, 256 rows at a time; then count
        the update, redraw the projections and zero the sketches."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._prepared is None:
            raise RuntimeError("LoGRAOptimizer.step() needs prepare_update() first: no update is prepared")
        alpha = float(alpha)
        if not math.isfinite(alpha) or alpha < 0:
            raise FloatingPointError(f"step scale alpha must be finite and >= 0, got {alpha}; no weight was changed")
        workspace = _UpdateWorkspace.allocate(self.sketches, self._rows, self.config)
        # Everything below runs in preallocated memory: an out-of-memory error can only
        # happen above, before any weight has changed, never halfway through the layers.
        for state, direction, (start, stop) in zip(self.sketches, self._prepared.directions, self._rows):
            weight = _local(state.weight)
            scaled, projection = workspace.scaled_and_projection(direction, state.projection, alpha)
            for row in range(0, stop - start, self.config.row_chunk):
                rows = slice(row, min(row + self.config.row_chunk, stop - start))
                weight[rows].addmm_(scaled[rows], projection, alpha=-1.0)  # in place: no product tensor
        for state, moment in zip(self.sketches, self._prepared.moments):
            state.second_moment.copy_(moment)
        self.update_count += 1
        self._finish_step()
        return loss

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
        """The prepared update as the KL probe needs it: full-row directions per layer
        (gathered from the owning ranks when rows are sharded)."""
        if self._prepared is None:
            raise RuntimeError("no update is prepared: call prepare_update() before probing it")
        directions = self._prepared.directions
        if self._weight_group is not None:
            directions = [_gather_rows(d, state.weight.shape[0], self._weight_group) for d, state in zip(directions, self.sketches)]
        return [
            ProbeLayer(module=state.module, projection=state.projection, direction=direction)
            for state, direction in zip(self.sketches, directions)
        ]

    # ----------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {
            "logra_config": self.config.to_dict(),
            "layers": [state.name for state in self.sketches],
            "update_count": self.update_count,
            "mismatch": self.mismatch,
            "second_moments": {state.name: self._moment_for_saving(state) for state in self.sketches},
            "param_groups": [{k: v for k, v in group.items() if k != "params"} for group in self.param_groups],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore moments, counter and mismatch EMA; re-derive the projections. A state
        written with another LoGRA configuration or other target layers is a ValueError."""
        missing = {"logra_config", "layers", "update_count", "mismatch", "second_moments"} - set(state_dict)
        if missing:
            raise ValueError(f"not a LoGRA optimizer state: missing {sorted(missing)}")
        mismatches = self.config.structural_mismatches(state_dict["logra_config"])
        if mismatches:
            raise ValueError("checkpoint was written with another LoGRA configuration: " + "; ".join(mismatches))
        names = [state.name for state in self.sketches]
        if list(state_dict["layers"]) != names:
            raise ValueError(
                f"checkpoint targets {len(state_dict['layers'])} layers that differ from this model's {len(names)}: "
                f"first difference at {_first_difference(state_dict['layers'], names)}"
            )
        moments = []
        for state in self.sketches:
            moment = state_dict["second_moments"][state.name]
            moment = moment.to_local() if hasattr(moment, "to_local") else moment
            if moment.shape != state.second_moment.shape:
                raise ValueError(f"second moment of {state.name}: shape {tuple(moment.shape)} != {tuple(state.second_moment.shape)}")
            if not torch.isfinite(moment).all():
                raise ValueError(f"second moment of {state.name} in the checkpoint is not finite")
            moments.append(moment)
        for state, moment in zip(self.sketches, moments):
            state.second_moment.copy_(moment)
        self.update_count = int(state_dict["update_count"])
        self.mismatch = float(state_dict["mismatch"])
        for group, saved in zip(self.param_groups, state_dict.get("param_groups", [])):
            group.update(saved)
        self._finish_step()

    # ----------------------------------------------------------------------------- helpers
    def _finish_step(self) -> None:
        self._prepared = None
        self.sketches.zero_()
        self._redraw()

    def _redraw(self) -> None:
        update = self.update_count if self.config.refresh else 0
        for state in self.sketches:
            seed = projection_seed(self.config.seed, update, state.name)
            rank, width = state.projection.shape
            state.projection.copy_(
                make_projection(rank, width, seed, device=state.projection.device, dtype=state.projection.dtype, distribution=self.config.distribution)
            )

    def backward_calls(self, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """Backward passes that reached each target since the last step, summed over ``group``."""
        calls = torch.tensor([state.backward_calls for state in self.sketches], dtype=torch.float64, device=self.sketches.buffer.device)
        if group is not None:
            dist.all_reduce(calls, op=dist.ReduceOp.SUM, group=group)
        return calls

    def _check_backward_reached(self, group: dist.ProcessGroup | None) -> None:
        calls = self.backward_calls(group)
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

    def _reduce_scatter(self, group: dist.ProcessGroup) -> list[torch.Tensor]:
        world = dist.get_world_size(group)
        pending = []
        for state, (start, stop) in zip(self.sketches, self._rows):
            rows, rank = state.sketch.shape
            chunk = -(-rows // world)
            source = state.sketch
            if chunk * world == rows:
                # In place: this rank's block of its own sketch receives the reduced rows,
                # so the reduction needs no memory beyond the accumulator.
                received = source[start : start + chunk]
            else:  # FSDP2's uneven split: pad the last ranks' blocks
                source = torch.zeros(chunk * world, rank, dtype=source.dtype, device=source.device)
                source[:rows] = state.sketch
                received = torch.empty(chunk, rank, dtype=source.dtype, device=source.device)
            work = dist.reduce_scatter_single(received, source, op=dist.ReduceOp.SUM, group=group, async_op=True)
            pending.append((work, received, stop - start))
        local = []
        for work, received, count in pending:
            work.wait()
            local.append(received[:count].div_(world))
        return local

    def _moment_for_saving(self, state) -> torch.Tensor:
        if self.reduction != "reduce_scatter":
            return state.second_moment
        from torch.distributed.tensor import DTensor, Shard

        mesh = state.weight.device_mesh
        rows = state.weight.shape[0]
        return DTensor.from_local(state.second_moment, mesh, [Shard(0)], run_check=False, shape=(rows, 1), stride=(1, 1))


@dataclass
class _UpdateWorkspace:
    """Buffers for applying W -= (alpha D rounded) A without allocating once started."""

    scaled: torch.Tensor  # rows x rank, compute dtype
    rounded: torch.Tensor  # rows x rank, the update factor dtype (rounding happens on copy)
    projection: torch.Tensor  # rank x width, compute dtype

    @classmethod
    def allocate(cls, sketches: SketchSet, rows: list[tuple[int, int]], config: LoGRAConfig) -> _UpdateWorkspace:
        dtypes = {_local(state.weight).dtype for state in sketches}
        if len(dtypes) != 1:
            raise ValueError(f"LoGRA target weights must share one dtype, found {sorted(map(str, dtypes))}")
        compute = dtypes.pop()
        if compute not in (torch.float32, torch.float64):
            raise ValueError(f"LoGRA needs float32 master weights for its targets, found {compute}")
        most_rows = max(stop - start for start, stop in rows)
        widest = max(state.projection.shape[1] for state in sketches)
        rank = sketches.states[0].projection.shape[0]
        device = sketches.buffer.device
        factor = getattr(torch, config.update_factor_dtype)
        return cls(
            scaled=torch.empty(most_rows, rank, dtype=compute, device=device),
            rounded=torch.empty(most_rows, rank, dtype=factor, device=device),
            projection=torch.empty(rank, widest, dtype=compute, device=device),
        )

    def scaled_and_projection(self, direction: torch.Tensor, projection: torch.Tensor, alpha: float):
        rows = direction.shape[0]
        scaled = self.scaled[:rows].copy_(direction).mul_(alpha)
        scaled.copy_(self.rounded[:rows].copy_(scaled))  # alpha * D rounded to the factor dtype
        if projection.dtype == self.projection.dtype:
            return scaled, projection
        return scaled, self.projection[:, : projection.shape[1]].copy_(projection)


def _local(weight: torch.Tensor) -> torch.Tensor:
    return weight.to_local() if hasattr(weight, "to_local") else weight


def _update_square_norm(direction: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """||D A||_F^2 through the r x r Gram matrix A A^T: no rows x width tensor is formed.

    The Gram matrix is computed in float32, which is exact for Rademacher projections (sums
    of +-1/r) and within float32 round-off for Gaussian ones; the rest runs in float64."""
    projection = projection.float()
    gram = (projection @ projection.T).double()
    direction = direction.double()
    return ((direction @ gram) * direction).sum()


def _weight_group(sketches: SketchSet) -> dist.ProcessGroup | None:
    """The process group over which target weights are row-sharded (None if unsharded)."""
    from torch.distributed.tensor import DTensor

    sharded = [isinstance(state.weight, DTensor) for state in sketches]
    if not any(sharded):
        return None
    if not all(sharded):
        raise ValueError("either every LoGRA target weight is an FSDP2 DTensor or none is")
    groups = {state.weight.device_mesh.get_group() for state in sketches}
    if len(groups) != 1:
        raise ValueError("LoGRA target weights are sharded over different process groups")
    return groups.pop()


def _resolve_reduction(requested: str, world: int, sharded: bool) -> str:
    if requested == "auto":
        return "reduce_scatter" if sharded and world > 1 else "all_reduce"
    if requested == "reduce_scatter" and not sharded:
        if world > 1:
            raise ValueError("sketch_reduction='reduce_scatter' needs target weights row-sharded with FSDP2")
        return "all_reduce"  # one rank owns every row: both reductions are the identity
    return requested


def _gather_rows(local: torch.Tensor, rows: int, group: dist.ProcessGroup) -> torch.Tensor:
    world = dist.get_world_size(group)
    chunk = -(-rows // world)
    padded = torch.zeros(chunk, local.shape[1], dtype=local.dtype, device=local.device)
    padded[: local.shape[0]] = local
    gathered = torch.empty(chunk * world, local.shape[1], dtype=local.dtype, device=local.device)
    dist.all_gather_single(gathered, padded, group=group)
    return gathered[:rows]


def _first_difference(saved: list[str], current: list[str]) -> str:
    for index, (a, b) in enumerate(zip(saved, current)):
        if a != b:
            return f"#{index}: {a!r} vs {b!r}"
    return f"#{min(len(saved), len(current))} (lengths {len(saved)} vs {len(current)})"
