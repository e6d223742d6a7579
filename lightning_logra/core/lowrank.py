"""A LoGRA update as a rollout engine can receive it: per target, the factor ``alpha D``
(rows x rank) and the seed of ``A``, instead of the whole rows x width weight.

Every update is ``W -= (alpha D, rounded) A`` with ``A`` re-derivable from its seed (drawn on
the CPU, the same matrix everywhere), so a copy of the weights kept elsewhere follows the
trainer's by applying the same product, with the same row chunks, in the same dtype: on one
device bit for bit. Sending these costs rank / width of a full weight sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_logra.core.config import LoGRAConfig
from lightning_logra.core.projection import make_projection, projection_seed
from lightning_logra.core.sketch import SketchSet


@dataclass(frozen=True)
class LowRankUpdate:
    """``weight -= factor @ A(seed)`` for the target whose weight is called ``name``."""

    name: str  # the weight's name in the policy's state dict, e.g. "model.layers.0.self_attn.q_proj.weight"
    factor: torch.Tensor  # alpha * D rounded as the trainer applied it, every row, float32 on CPU
    seed: int
    width: int
    distribution: str
    projection_dtype: torch.dtype
    chunk_rows: int  # rows per chunk of the product, as the trainer applied it (update_chunk_rows)

    @property
    def nbytes(self) -> int:
        """What sending it costs: the factor and one 8-byte seed."""
        return self.factor.numel() * self.factor.element_size() + 8

    def projection(self) -> torch.Tensor:
        return make_projection(self.factor.shape[1], self.width, self.seed, dtype=self.projection_dtype,
                               distribution=self.distribution)

    @torch.no_grad()
    def apply_to(self, weight: torch.Tensor) -> None:
        """The trainer's own arithmetic (``update.apply_directions``), on a full weight."""
        projection = self.projection().to(weight.dtype)
        factor = self.factor.to(weight.dtype)
        for row in range(0, weight.shape[0], self.chunk_rows):
            chunk = slice(row, min(row + self.chunk_rows, weight.shape[0]))
            weight[chunk].addmm_(factor[chunk], projection, alpha=-1.0)


def low_rank_updates(sketches: SketchSet, factors: list[torch.Tensor], config: LoGRAConfig,
                     update: int) -> list[LowRankUpdate]:
    """The updates of step ``update`` (before it is counted), from each target's full-row
    factor: the A each target used was drawn for this update number (``redraw_projections``) or once."""
    return [
        LowRankUpdate(
            name=f"{state.name}.weight",
            factor=factor.detach().float().cpu(),
            seed=projection_seed(config.seed, update if config.redraw_projections else 0, state.projection_name),
            width=state.source.width,
            distribution=config.distribution,
            projection_dtype=state.source.dtype,
            chunk_rows=config.update_chunk_rows,
        )
        for state, factor in zip(sketches, factors)
    ]


def scaled_factor(direction: torch.Tensor, alpha: float, config: LoGRAConfig, dtype: torch.dtype) -> torch.Tensor:
    """``alpha * D`` rounded through ``update_factor_dtype``, as ``apply_directions`` applies it."""
    scaled = direction.to(dtype) * alpha
    return scaled.to(getattr(torch, config.update_factor_dtype)).to(dtype)
