"""RowAdam: Adam without a first moment, with one second moment per output row.

E[mean_j S_ij^2] = ||g_i||^2 / r whatever A is, so the row statistic survives the
projection being redrawn every update. The arithmetic runs on row blocks: when a layer's
rows are spread over ranks, the few per-layer scalars (sums, minimum, norms) are reduced
across them, so each rank only ever holds its own rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

TINY = torch.finfo(torch.float32).tiny


def row_adam_direction(
    sketch: torch.Tensor,
    second_moment: torch.Tensor,
    *,
    step: int,
    beta2: float = 0.95,
    epsilon: float = 1e-8,
) -> torch.Tensor:
    """The RowAdam direction D (same shape as ``sketch``) for one whole layer.

    ``sketch`` is S_hat = S / N; ``second_moment`` (rows x 1) is updated in place; ``step``
    counts from 1. A non-finite sketch raises ``FloatingPointError`` and leaves the moment
    untouched; an all-zero sketch gives an all-zero direction.
    """
    return row_adam_directions([sketch], [second_moment], step=step, beta2=beta2, epsilon=epsilon)[0]


def row_adam_directions(
    sketches: Sequence[torch.Tensor],
    second_moments: Sequence[torch.Tensor],
    *,
    step: int,
    beta2: float,
    epsilon: float,
    names: Sequence[str] | None = None,
    row_group: dist.ProcessGroup | None = None,
    inplace: bool = False,
) -> list[torch.Tensor]:
    """RowAdam for many layers at once.

    With ``row_group``, each rank passes only the rows it owns of every layer and the
    per-layer scalars are all-reduced over the group (four small collectives in all,
    whatever the number of layers). Without it, each sketch holds all of its layer's rows.
    With ``inplace`` the directions overwrite the sketches (no second d x r buffer).
    """
    if step < 1:
        raise ValueError(f"RowAdam step counts from 1, got {step}")
    count = len(sketches)
    device = sketches[0].device if count else torch.device("cpu")

    nonfinite = torch.stack([(~torch.isfinite(s)).any().float() for s in sketches])
    _all_reduce(nonfinite, dist.ReduceOp.SUM, row_group)
    if nonfinite.any():
        bad = [(names[i] if names else f"#{i}") for i in range(count) if nonfinite[i] > 0]
        listed = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more layers" if len(bad) > 3 else "")
        raise FloatingPointError(f"non-finite values in the sketch of {listed}; no update was prepared")

    row_mean_squares = [s.pow(2).mean(dim=1, keepdim=True) for s in sketches]
    for moment, mean_square in zip(second_moments, row_mean_squares):
        moment.mul_(beta2).add_(mean_square, alpha=1.0 - beta2)
    correction = 1.0 - beta2**step
    rhos = [(moment / correction).sqrt() for moment in second_moments]

    # Relative epsilon: eps times the layer's mean row RMS.
    rho_sums = torch.stack([torch.stack([rho.sum(), torch.tensor(float(rho.numel()), device=device)]) for rho in rhos])
    _all_reduce(rho_sums, dist.ReduceOp.SUM, row_group)
    denominators = []
    for rho, (rho_sum, rows) in zip(rhos, rho_sums):
        shift = torch.clamp(epsilon * rho_sum / rows, min=TINY)
        denominators.append(rho + shift)

    # min(den) / den lies in (0, 1]: proportional to 1/den without overflow.
    minima = torch.stack([den.min() if den.numel() else torch.tensor(float("inf"), device=device) for den in denominators])
    _all_reduce(minima, dist.ReduceOp.MIN, row_group)
    scales = [minimum / den for minimum, den in zip(minima, denominators)]

    norms = torch.stack(
        [
            torch.stack([scale.pow(2).sum(), sketch.pow(2).sum(), (scale * sketch).pow(2).sum()])
            for scale, sketch in zip(scales, sketches)
        ]
    )
    _all_reduce(norms, dist.ReduceOp.SUM, row_group)

    directions = []
    for scale, sketch, (scale_square_sum, sketch_square_sum, scaled_square_sum), (_, rows) in zip(
        scales, sketches, norms, rho_sums
    ):
        rms = (scale_square_sum / rows).sqrt()
        # RMS of the row scales over the layer is 1
        direction = sketch.mul_(scale / rms) if inplace else (scale / rms) * sketch
        direction_norm = scaled_square_sum.sqrt() / rms
        # Keep the layer's sketch norm ||S_hat||_F; an all-zero sketch stays all zero.
        # torch.where instead of an `if` keeps the GPU free of a sync per layer.
        restore = torch.where(direction_norm > 0, sketch_square_sum.sqrt() / direction_norm, 0.0)
        directions.append(direction.mul_(restore))
    return directions


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> None:
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)
