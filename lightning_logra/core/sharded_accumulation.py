"""Sketch accumulators sharded by weight rows: each rank keeps only the rows it owns.

Under FSDP2 a rank owns a block of every target's weight rows, but its own tokens touch
every row, so a local accumulator is d x r on every rank. Instead, as FSDP does for dense
gradients, each layer's contribution dY^T P is reduce-scattered along rows as soon as that
layer's backward has produced it, and the rank adds its block into an accumulator of its
own rows only ((d / W) x r). The full d x r contribution lives in one of a few scratch
slots sized for the largest layer; each slot's collective runs asynchronously while the
backward of the next layers proceeds, and is waited (and its rows added) when the slot is
needed again or before the update reads the sketches.

The collectives run on a process group of their own, so a check over the weight group at
the step (``check_backward_calls``) can never be mistaken for one of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_logra.core.sketch import SketchSet, SketchState, add_outer

# Two slots: one layer's reduction runs while the next layer's backward computes its own.
SCRATCH_SLOTS = 2


@dataclass(eq=False)
class _Slot:
    """One in-flight reduction: a padded full contribution and the rank's received block."""

    contribution: torch.Tensor  # (chunk * world) x rank rows of the largest layer
    received: torch.Tensor  # chunk x rank rows of the largest layer
    work: dist.Work | None = None
    state: SketchState | None = None
    owned: int = 0  # the rows of them this rank owns (the last ranks may own fewer)


class ShardedAccumulator:
    """Reduce-scatters every sketch contribution in backward into per-rank row blocks.

    Constructing it replaces ``sketches.buffer`` by one holding only this rank's rows of
    every target (``rows[i]`` = the global [start, stop) rows the rank owns, as FSDP2 splits
    them) and points each ``state.sketch`` at its block; the sketch hooks then hand their
    contributions to ``add``. ``slots`` full-size scratch buffers bound the transient memory.
    """

    def __init__(self, sketches: SketchSet, rows: list[tuple[int, int]], chunks: list[int],
                 weight_group: dist.ProcessGroup, slots: int = SCRATCH_SLOTS) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.sketches = sketches
        self.world = dist.get_world_size(weight_group)
        # Its own group: in-flight reductions never pair with the step's collectives.
        self.group = dist.new_group(ranks=dist.get_process_group_ranks(weight_group))
        rank = sketches.rank
        device = sketches.buffer.device
        # rows per rank of each layer's padded contribution, as FSDP2 splits them (layout.rows_per_rank)
        self._chunks = {id(state): chunk for state, chunk in zip(sketches, chunks)}
        owned = [stop - start for start, stop in rows]
        buffer = torch.zeros(sum(owned) * rank, dtype=torch.float32, device=device)
        offset = 0
        for state, count in zip(sketches, owned):
            state.sketch = buffer[offset : offset + count * rank].view(count, rank)
            state.accumulator = self
            offset += count * rank
        sketches.buffer = buffer
        sketches.accumulator = self
        largest = max(self._chunks.values())
        self._slots = [
            _Slot(contribution=torch.empty(largest * self.world, rank, dtype=torch.float32, device=device),
                  received=torch.empty(largest, rank, dtype=torch.float32, device=device))
            for _ in range(slots)
        ]
        self._next = 0
        self.bytes_sent = 0  # since construction, as a ring reduce-scatter sends (W - 1) / W of its input

    @property
    def scratch_bytes(self) -> int:
        return sum(slot.contribution.numel() + slot.received.numel() for slot in self._slots) * 4

    def add(self, state: SketchState, grad_rows: torch.Tensor, projected: torch.Tensor) -> None:
        """Start reducing dY^T P of ``state``'s layer; this rank's rows land in its sketch."""
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        self._finish(slot)
        chunk = self._chunks[id(state)]
        rows = state.module.out_features
        contribution = slot.contribution[: chunk * self.world]
        # zero, then add: the same arithmetic as a local accumulator's first micro-batch,
        # so one micro-batch per step reduces to the same bits as the per-step reduction
        contribution.zero_()
        add_outer(contribution[:rows], grad_rows, projected)
        received = slot.received[:chunk]
        slot.work = dist.reduce_scatter_single(received, contribution, op=dist.ReduceOp.SUM, group=self.group,
                                               async_op=True)
        slot.state, slot.owned = state, state.sketch.shape[0]
        self.bytes_sent += contribution.numel() * 4 * (self.world - 1) // self.world

    def wait(self) -> None:
        """Wait for every in-flight reduction and add its rows into the sketches."""
        for slot in self._slots:
            self._finish(slot)

    def discard(self) -> None:
        """Wait for the in-flight reductions (every rank must complete them) and drop them."""
        for slot in self._slots:
            if slot.work is not None:
                slot.work.wait()
            slot.work = slot.state = None

    def _finish(self, slot: _Slot) -> None:
        if slot.work is None:
            return
        slot.work.wait()
        slot.state.sketch.add_(slot.received[: slot.owned])
        slot.work = None
        slot.state = None


def check_backward_calls(calls: torch.Tensor, group: dist.ProcessGroup | None, names: list[str]) -> torch.Tensor:
    """The backward passes each target ran on the rank that ran most; every rank must have
    run the same ones, since each pass reduces its contributions with the other ranks'.

    Raises ``RuntimeError`` on every rank together when the counts differ."""
    if group is None:
        return calls
    spread = torch.cat([calls, -calls])
    dist.all_reduce(spread, op=dist.ReduceOp.MAX, group=group)
    most, fewest = spread[: len(calls)], -spread[len(calls) :]
    if not torch.equal(most, fewest):
        uneven = [f"{name} ({int(a)} to {int(b)})" for name, a, b in zip(names, fewest.tolist(), most.tolist()) if a != b]
        raise RuntimeError(
            "ranks ran different numbers of backward passes through the LoGRA targets since the last step: "
            + ", ".join(uneven[:3]) + (" ..." if len(uneven) > 3 else "")
            + ". sketch_accumulation: sharded reduces every pass with the other ranks (as FSDP2 reduces gradients), "
            "so every rank must run the same micro-batches; give every rank the same number, "
            "or set logra.sketch_accumulation: local"
        )
    return most
