"""How many bytes LoGRA keeps per rank, next to what dense AdamW would keep.

Computed from layer shapes alone, so a 7B or 27B configuration can be reported from a
``meta``-device model without any weights.
"""

from __future__ import annotations

import resource
from dataclasses import asdict, dataclass

import torch
from torch import nn

from lightning_logra.core.config import LoGRAConfig
from lightning_logra.core.layout import choose_layout, rows_per_rank
from lightning_logra.core.projected_input import projection_groups
from lightning_logra.core.projection import projection_storage_dtype, resolve_rank
from lightning_logra.core.sharded_accumulation import SCRATCH_SLOTS
from lightning_logra.core.sketch import find_targets

FLOAT32 = 4


@dataclass(frozen=True)
class MemoryReport:
    """Bytes per rank. ``logra_state_bytes`` is what LoGRA adds to the model's weights;
    ``dense_adamw_bytes`` is a float32 gradient plus AdamW's two moments for the same
    target weights (sharded over the ranks, as FSDP does); ``reference_bytes`` is the
    reference layout (float32 sketches and projections replicated on every rank). With
    sharded accumulation the accumulator holds the rank's rows only, and
    ``accumulation_scratch_bytes`` is the slots that carry one layer's full contribution
    while it is reduce-scattered. With ``regenerate_projections`` no projection is held
    (``projection_bytes`` is 0) and ``projection_draw_bytes`` is the transient of one draw
    of the widest A (its bits and the matrix), live while that A is used."""

    layers: int
    target_parameters: int
    rank: int
    world_size: int
    sketch_accumulator_bytes: int
    accumulation_scratch_bytes: int
    projection_bytes: int
    projection_draw_bytes: int
    second_moment_bytes: int
    logra_state_bytes: int
    dense_adamw_bytes: int
    reference_bytes: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def memory_report(
    model: nn.Module,
    config: LoGRAConfig | None = None,
    *,
    world_size: int = 1,
    compute_dtype: torch.dtype = torch.bfloat16,
    sketch_reduction: str | None = None,
    sketch_accumulation: str | None = None,
) -> MemoryReport:
    """LoGRA's per-rank memory for ``model``'s targets at ``world_size`` data-parallel ranks.

    Under the reduce-scatter layout (default when world_size > 1) each rank reduces, scales
    and keeps moments for its own rows only; with sharded accumulation (its default) it
    also accumulates only those rows, each layer's contribution reduce-scattered in backward
    through ``ShardedAccumulator``'s scratch slots. With local accumulation, or under
    all-reduce, every rank accumulates a full float32 sketch (its own tokens touch every
    row). The reduced sketch and the RowAdam directions live inside the accumulator. Not
    counted: the update's transient workspace (one layer's rows x rank plus one 256-row
    chunk) and, when rows are sharded, the one layer's full-row direction that the probe
    gathers at a time.
    """
    config = config or LoGRAConfig()
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    layout, accumulation = choose_layout(sketch_reduction or config.sketch_reduction,
                                         sketch_accumulation or config.sketch_accumulation, world_size)
    sharded_rows = layout == "reduce_scatter"
    sharded_accumulation = accumulation == "sharded"
    targets = find_targets(model, config.target_modules)
    rank = resolve_rank(config.rank, [module.in_features for _, module in targets])
    rows = sum(module.out_features for _, module in targets)
    widths = sum(module.in_features for _, module in targets)
    # A shared projection (share_projection_by_input) is stored once per group.
    groups = projection_groups(targets) if config.share_projection_by_input else [[i] for i in range(len(targets))]
    projection_widths = sum(targets[members[0]][1].in_features for members in groups)
    parameters = sum(module.out_features * module.in_features for _, module in targets)
    projection_dtype = projection_storage_dtype(rank, config.distribution, compute_dtype)
    projection_element = torch.empty((), dtype=projection_dtype).element_size()

    chunks = [rows_per_rank(module.out_features, world_size) for _, module in targets]
    owned_rows = sum(chunks) if sharded_rows else rows
    accumulator = (owned_rows if sharded_accumulation else rows) * rank * FLOAT32
    scratch = SCRATCH_SLOTS * max(chunks) * (world_size + 1) * rank * FLOAT32 if sharded_accumulation else 0
    # The reduced sketch becomes the RowAdam directions in place, inside the accumulator
    # (reduce-scatter receives each rank's rows into its own block of it). Only layers
    # whose rows do not split evenly over the ranks need a padded copy (not counted).
    projections = 0 if config.regenerate_projections else projection_widths * rank * projection_element
    widest = max(module.in_features for _, module in targets)
    draw = widest * rank * (1 + projection_element) if config.regenerate_projections else 0
    moments = owned_rows * FLOAT32
    return MemoryReport(
        layers=len(targets),
        target_parameters=parameters,
        rank=rank,
        world_size=world_size,
        sketch_accumulator_bytes=accumulator,
        accumulation_scratch_bytes=scratch,
        projection_bytes=projections,
        projection_draw_bytes=draw,
        second_moment_bytes=moments,
        logra_state_bytes=accumulator + scratch + projections + moments,
        dense_adamw_bytes=rows_per_rank(parameters, world_size) * 3 * FLOAT32,
        reference_bytes=(rows + widths) * rank * FLOAT32,
    )


def peak_memory_mib() -> dict[str, float]:
    """This process's peak memory so far: the CUDA allocator's peaks on a GPU, else the
    process's resident-set high-water mark (Linux reports it in KiB)."""
    if torch.cuda.is_available():
        return {
            "peak_allocated_mib": torch.cuda.max_memory_allocated() / 2**20,
            "peak_reserved_mib": torch.cuda.max_memory_reserved() / 2**20,
        }
    return {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
