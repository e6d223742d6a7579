"""Applying a prepared LoGRA update: W -= (alpha D, rounded) A for every target, row chunk
by row chunk, in memory allocated before the first weight changes; and ||D A||_F without
forming D A."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_logra.core.config import LoGRAConfig
from lightning_logra.core.projection import Projection
from lightning_logra.core.sketch import SketchSet


@dataclass(frozen=True)
class PreparedUpdate:
    """What prepare_update computed; directions are already scaled to update_ratio. They
    occupy the spent sketch buffers, so they are valid until apply_update() or skip_update()."""

    directions: list[torch.Tensor]  # local rows x rank, float32, per layer
    moments: list[torch.Tensor]  # RowAdam second moments after this step, committed on apply
    sketch_norm: float  # ||S_hat||_F over all layers
    weight_norm: float  # ||W||_F over all target weights
    update_norm: float  # ||D A||_F over all layers (= update_ratio * weight_norm)


def apply_directions(sketches: SketchSet, directions: list[torch.Tensor], rows: list[tuple[int, int]], alpha: float,
                     config: LoGRAConfig) -> None:
    """W[rows] -= (alpha * D rounded to ``update_factor_dtype``) @ A for each target's
    local rows, ``update_chunk_rows`` rows at a time."""
    workspace = _UpdateWorkspace.allocate(sketches, rows, config)
    # Everything below runs in preallocated memory: an out-of-memory error can only
    # happen above, before any weight has changed, never halfway through the layers.
    for state, direction, (start, stop) in zip(sketches, directions, rows):
        weight = local_rows(state.weight)
        scaled, projection = workspace.scaled_and_projection(direction, state.source, alpha)
        for row in range(0, stop - start, config.update_chunk_rows):
            chunk = slice(row, min(row + config.update_chunk_rows, stop - start))
            weight[chunk].addmm_(scaled[chunk], projection, alpha=-1.0)  # in place: no product tensor


@dataclass
class _UpdateWorkspace:
    """Buffers for applying W -= (alpha D rounded) A without allocating once started."""

    scaled: torch.Tensor  # rows x rank, compute dtype
    rounded: torch.Tensor  # rows x rank, the update factor dtype (rounding happens on copy)
    projection: torch.Tensor  # rank x width, compute dtype
    bits: torch.Tensor | None  # uint8 on the CPU, rank x width: regenerated projections are drawn through it

    @classmethod
    def allocate(cls, sketches: SketchSet, rows: list[tuple[int, int]], config: LoGRAConfig) -> _UpdateWorkspace:
        dtypes = {local_rows(state.weight).dtype for state in sketches}
        if len(dtypes) != 1:
            raise ValueError(f"LoGRA target weights must share one dtype, found {sorted(map(str, dtypes))}")
        compute = dtypes.pop()
        if compute not in (torch.float32, torch.float64):
            raise ValueError(f"LoGRA needs float32 master weights for its targets, found {compute}")
        most_rows = max(stop - start for start, stop in rows)
        widest = max(state.source.width for state in sketches)
        rank = sketches.rank
        device = sketches.buffer.device
        factor = getattr(torch, config.update_factor_dtype)
        return cls(
            scaled=torch.empty(most_rows, rank, dtype=compute, device=device),
            rounded=torch.empty(most_rows, rank, dtype=factor, device=device),
            projection=torch.empty(rank, widest, dtype=compute, device=device),
            bits=(torch.empty(rank * widest, dtype=torch.uint8)
                  if any(state.source.stored is None for state in sketches) else None),
        )

    def scaled_and_projection(self, direction: torch.Tensor, source: Projection, alpha: float):
        rows = direction.shape[0]
        scaled = self.scaled[:rows].copy_(direction).mul_(alpha)
        scaled.copy_(self.rounded[:rows].copy_(scaled))  # alpha * D rounded to the factor dtype
        workspace = self.projection[:, : source.width]
        if source.stored is None:
            return scaled, source.draw_into(workspace, self.bits)
        if source.stored.dtype == self.projection.dtype:
            return scaled, source.stored
        return scaled, workspace.copy_(source.stored)


def update_square_norm(direction: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """||D A||_F^2 through the r x r Gram matrix A A^T: no rows x width tensor is formed.

    The Gram matrix is computed in float32, which is exact for Rademacher projections (sums
    of +-1/r) and within float32 round-off for Gaussian ones; the rest runs in float64."""
    projection = projection.float()
    gram = (projection @ projection.T).double()
    direction = direction.double()
    return ((direction @ gram) * direction).sum()


def local_rows(weight: torch.Tensor) -> torch.Tensor:
    """The rows this rank holds: the local shard of an FSDP2 DTensor, else the tensor."""
    return weight.to_local() if hasattr(weight, "to_local") else weight
