"""How the rows of every target are split across ranks, and what that means for one update.

Two layouts, one interface, so that the optimizer reads like the spec whatever the sharding:

- ``ReplicatedRows`` (the reference): sketches are all-reduced, every rank runs RowAdam on
  every row; with row-sharded weights each rank then keeps the rows it updates.
- ``ShardedRows`` (ours): sketches are reduce-scattered along rows to the rank that owns
  those weight rows; RowAdam runs on owned rows only, its per-layer scalars all-reduced.
  With sharded accumulation the reduce-scatter already happened in backward, per layer
  and micro-batch (``sharded_accumulation.py``), and each rank accumulates its rows only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist

from lightning_logra.core.sharded_accumulation import ShardedAccumulator, check_backward_calls
from lightning_logra.core.sketch import SketchSet, SketchState


def rows_per_rank(rows: int, world: int) -> int:
    """FSDP2's split of ``rows`` over ``world`` ranks, like ``torch.chunk``: ceil(rows / world)
    rows each, the last ranks getting fewer (or none). The one row-split rule."""
    return -(-rows // world)


def choose_layout(requested: str, accumulation: str, world: int) -> tuple[str, str]:
    """(layout, accumulation) for target weights row-sharded over ``world`` ranks (1: not
    sharded): ``reduce_scatter`` when rows are sharded and the configuration allows it
    (``auto`` or ``reduce_scatter``), then ``sharded`` accumulation unless ``local`` is asked;
    else ``all_reduce`` with ``local`` accumulation. ``make_layout`` and ``memory_report``
    both decide here."""
    if world > 1 and requested in ("auto", "reduce_scatter"):
        return "reduce_scatter", "sharded" if accumulation in ("auto", "sharded") else "local"
    return "all_reduce", "local"


def local_row_range(weight: torch.Tensor) -> tuple[int, int]:
    """The global [start, stop) rows of ``weight`` held by this rank.

    Plain tensors hold every row. FSDP2 DTensors sharded on dim 0 hold one contiguous
    block; FSDP2 splits like torch.chunk (the first ranks get ceil(d / world) rows).
    """
    from torch.distributed.tensor import DTensor, Shard

    rows = weight.shape[0]
    if not isinstance(weight, DTensor):
        return 0, rows
    placements = weight.placements
    if len(placements) != 1 or placements[0] != Shard(0):
        raise ValueError(
            f"LoGRA can update weights sharded on dim 0 over a 1-D mesh only; got placements {placements}"
        )
    world = weight.device_mesh.size()
    coordinate = weight.device_mesh.get_local_rank()
    chunk = rows_per_rank(rows, world)
    start = min(coordinate * chunk, rows)
    stop = min(start + chunk, rows)
    local_rows = weight.to_local().shape[0]
    if local_rows != stop - start:
        raise ValueError(f"unexpected shard of {local_rows} rows (expected {stop - start}) for a weight of {rows} rows")
    return start, stop




class RowLayout:
    """What both layouts share: the weight shards' group and each target's owned rows."""

    def __init__(self, sketches: SketchSet, weight_group: dist.ProcessGroup | None) -> None:
        self.sketches = sketches
        self.weight_group = weight_group  # None: every rank holds whole weights
        self.rows = [local_row_range(state.weight) for state in sketches]
        # Bytes this rank has sent reducing sketches, as a ring algorithm sends them
        # (all-reduce 2 (W - 1) / W of the buffer, reduce-scatter (W - 1) / W).
        self.reduced_bytes_sent = 0

    @property
    def sketch_bytes_sent(self) -> int:
        return self.reduced_bytes_sent

    # RowAdam reduces its per-layer scalars over this group (None: each rank has whole layers)
    row_group: dist.ProcessGroup | None = None
    accumulation = "local"

    def backward_calls(self, calls: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        """This rank's backward passes per target, summed over ``group``."""
        if group is not None:
            dist.all_reduce(calls, op=dist.ReduceOp.SUM, group=group)
        return calls

    def sum_over_shards(self, values: torch.Tensor) -> None:
        """Sum per-rank partial sums over the owned rows (weight norms, update norms)."""
        if self.weight_group is not None:
            dist.all_reduce(values, op=dist.ReduceOp.SUM, group=self.weight_group)

    def full_rows(self, directions: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every row of every direction (the probe moves the whole model)."""
        if self.weight_group is None:
            return directions
        return [_gather_rows(d, state.weight.shape[0], self.weight_group) for d, state in zip(directions, self.sketches)]

    def row_gatherers(self) -> list[Callable[[torch.Tensor], torch.Tensor] | None]:
        """Per target, what turns this rank's rows of a direction into every row when the
        probe reaches the layer (None: the rank holds every row already)."""
        if self.weight_group is None:
            return [None] * len(self.sketches)
        return [functools.partial(_gather_rows, rows=state.weight.shape[0], group=self.weight_group) for state in self.sketches]


class ReplicatedRows(RowLayout):
    name = "all_reduce"

    def local_moments(self) -> list[torch.Tensor]:
        """Each target's RowAdam moment as this layout keeps it: every row."""
        return [state.second_moment for state in self.sketches]

    def reduce(self, tokens: float, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
        """S_hat = (sum over ranks / world) / N, in place in the flat buffer: one collective."""
        buffer = self.sketches.buffer
        world = dist.get_world_size(group) if group is not None else 1
        if world > 1:
            dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)
            self.reduced_bytes_sent += 2 * buffer.numel() * buffer.element_size() * (world - 1) // world
        buffer.div_(world * tokens)
        return [state.sketch for state in self.sketches]

    def own_rows(self, directions: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.weight_group is None:
            return directions
        return [d[start:stop].clone() for d, (start, stop) in zip(directions, self.rows)]

    def moment_to_save(self, state: SketchState) -> torch.Tensor:
        return state.second_moment


class ShardedRows(RowLayout):
    name = "reduce_scatter"

    def __init__(self, sketches: SketchSet, weight_group: dist.ProcessGroup, accumulate_sharded: bool) -> None:
        super().__init__(sketches, weight_group)
        world = dist.get_world_size(weight_group)
        chunks = [rows_per_rank(state.weight.shape[0], world) for state in sketches]
        self.accumulator = ShardedAccumulator(sketches, self.rows, chunks, weight_group) if accumulate_sharded else None

    @property
    def accumulation(self) -> str:
        return "local" if self.accumulator is None else "sharded"

    def backward_calls(self, calls: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        """Per target, the passes of the rank that ran most (zero on every rank, or not);
        with sharded accumulation every rank must have run the same ones."""
        if self.accumulator is None:
            return super().backward_calls(calls, group)
        return check_backward_calls(calls, group, [state.name for state in self.sketches])

    @property
    def sketch_bytes_sent(self) -> int:
        return self.reduced_bytes_sent + (self.accumulator.bytes_sent if self.accumulator is not None else 0)

    @property
    def row_group(self) -> dist.ProcessGroup | None:
        return self.weight_group

    def local_moments(self) -> list[torch.Tensor]:
        """Each target's RowAdam moment as this layout keeps it: the owned rows only."""
        return [state.second_moment[start:stop].clone() for state, (start, stop) in zip(self.sketches, self.rows)]

    def reduce(self, tokens: float, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
        """This rank's rows of S_hat, reduce-scattered over the weight shards' group."""
        group = self.weight_group
        world = dist.get_world_size(group)
        if self.accumulator is not None:  # reduced in backward already
            self.accumulator.wait()
            return [state.sketch.div_(world).div_(tokens) for state in self.sketches]
        pending = []
        for state, (start, stop) in zip(self.sketches, self.rows):
            rows, rank = state.sketch.shape
            chunk = rows_per_rank(rows, world)
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
            self.reduced_bytes_sent += source.numel() * source.element_size() * (world - 1) // world
            pending.append((work, received, stop - start))
        local = []
        for work, received, count in pending:
            work.wait()
            local.append(received[:count].div_(world).div_(tokens))
        return local

    def own_rows(self, directions: list[torch.Tensor]) -> list[torch.Tensor]:
        return directions

    def moment_to_save(self, state: SketchState) -> torch.Tensor:
        """The owned rows as one DTensor, so a checkpoint holds every row exactly once."""
        from torch.distributed.tensor import DTensor, Shard

        rows = state.weight.shape[0]
        return DTensor.from_local(state.second_moment, state.weight.device_mesh, [Shard(0)], run_check=False,
                                  shape=(rows, 1), stride=(1, 1))


def make_layout(requested: str, sketches: SketchSet, accumulation: str = "auto") -> RowLayout:
    """``auto``: reduce-scatter when the weights are row-sharded over more than one rank,
    and then (``accumulation`` ``auto`` or ``sharded``) already in backward."""
    group = weight_group(sketches)
    world = dist.get_world_size(group) if group is not None else 1
    if requested == "reduce_scatter" and group is None and dist.is_available() and dist.is_initialized() \
            and dist.get_world_size() > 1:
        raise ValueError("sketch_reduction='reduce_scatter' needs target weights row-sharded with FSDP2")
    layout, accumulation = choose_layout(requested, accumulation, world if group is not None else 1)
    if layout == ReplicatedRows.name:
        return ReplicatedRows(sketches, group)
    return ShardedRows(sketches, group, accumulate_sharded=accumulation == "sharded")


def weight_group(sketches: SketchSet) -> dist.ProcessGroup | None:
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


def _gather_rows(local: torch.Tensor, rows: int, group: dist.ProcessGroup) -> torch.Tensor:
    world = dist.get_world_size(group)
    chunk = rows_per_rank(rows, world)
    padded = torch.zeros(chunk, local.shape[1], dtype=local.dtype, device=local.device)
    padded[: local.shape[0]] = local
    gathered = torch.empty(chunk * world, local.shape[1], dtype=local.dtype, device=local.device)
    dist.all_gather_single(gathered, padded, group=group)
    return gathered[:rows]
