"""One-step-off-policy rollouts, the trainer's side (``rollout.max_staleness > 0``): which
prompt batches the worker process (``rollout.worker``) samples ahead, with which seeds, and
what reaches it after each training step.

Versions: the policy's version is the number of training steps (prompt batches) it has
trained on, Lightning's count of completed batches, which a checkpoint saves with the data
position. Before training on batch k the module asks for batches k+1 .. k+max_staleness;
they queue behind the update of step k-1, so batch k+1 is sampled at version k and trained
at version k+1: one step stale. Batches in flight are never saved: a resumed run starts a
fresh worker from the restored weights and samples its first batch synchronously.

Which batches come next: the train loader's order is fixed by its sampler (seed, epoch,
resume position), so a second pass over it, started with the epoch, yields the batches
Lightning will hand the module. The module's batch is checked against the one sampled for
it. The pipeline does not look past the end of an epoch nor past ``max_steps``: the first
step of an epoch waits for its own generation.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from lightning_logra.rollout.base import Rollouts
from lightning_logra.rollout.worker import RolloutWorker


@dataclass
class _Request:
    index: int  # the batch's position in the run: training steps before it
    prompts: list[str]


class AsyncRollouts:
    """The module's rollouts when they come from a worker process. ``start_worker`` builds
    it (``RolloutWorker``); ``seed_of(index)`` is the sampling seed of batch ``index``."""

    def __init__(self, start_worker: Callable[[], RolloutWorker], *, max_staleness: int, num_generations: int,
                 seed_of: Callable[[int], int], full_sync_every: int = 50) -> None:
        self._start_worker = start_worker
        self.full_sync_every = full_sync_every
        self.max_staleness = max_staleness
        self.num_generations = num_generations
        self._seed_of = seed_of
        self.worker: RolloutWorker | None = None
        self._pending: deque[_Request] = deque()
        self._upcoming: Iterator | None = None  # this epoch's second pass over the train loader
        self._epoch: int | None = None

    @property
    def last_sync_bytes(self) -> int | None:
        return None if self.worker is None else self.worker.last_sync_bytes

    def rollouts(self, batch: dict[str, list], *, index: int, epoch: int, loader, last_index: int | None,
                 policy: nn.Module) -> tuple[Rollouts, int]:
        """The rollouts of ``batch``, training step ``index`` of ``epoch``, and the version that
        sampled them; first asks for those of the next ``max_staleness`` batches (not past
        ``last_index``, the run's last step where known). ``policy`` seeds a new worker."""
        if self.worker is None:
            self.worker = self._start_worker()
            self.worker.load(trained_weights(policy, trainable_only=False), version=index)
        if epoch != self._epoch:  # a new pass, whose first batch is this one
            self._drop_pending()
            self._epoch, self._upcoming = epoch, iter(loader)
        if not self._pending:
            self._submit(index, self._next_prompts())
        while len(self._pending) <= self.max_staleness and (last_index is None or self._next_index() <= last_index):
            prompts = self._next_prompts()
            if prompts is None:
                break
            self._submit(self._next_index(), prompts)
        request = self._pending.popleft()
        if request.index != index or request.prompts != list(batch["prompt_text"]):
            raise RuntimeError(
                f"rollout.max_staleness > 0: training step {index} was handed other prompts than the train loader's "
                f"order gave for it (sampled for step {request.index}): the pipeline samples ahead by iterating the "
                "train loader a second time, which needs a loader whose order is fixed by its seed and epoch")
        rollouts, version = self.worker.receive(request.index)
        if index - version > self.max_staleness:
            raise RuntimeError(f"rollouts of step {index} were sampled at version {version}, more than "
                               f"rollout.max_staleness = {self.max_staleness} steps old")
        return rollouts, version

    def sync(self, policy: nn.Module, low_rank_updates: list, *, version: int) -> None:
        """After a training step: its LoGRA updates (``low_rank_updates``, all of them) and the
        weights trained otherwise (every weight for dense, the adapters for LoRA; under LoGRA
        none, unless non-targets train); the worker's policy becomes ``version``. Every
        ``full_sync_every``-th version reached by LoGRA updates gets every weight instead: under FSDP2
        the trainer applies each update to its row shard, the worker to whole weights, and
        the two round differently (by up to about 1e-7 per update); one process stays exact."""
        if low_rank_updates and version % self.full_sync_every == 0:
            self.worker.load(trained_weights(policy, trainable_only=False), version)
        else:
            self.worker.update(low_rank_updates, trained_weights(policy, trainable_only=True), version)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None
        self._pending.clear()
        self._epoch = self._upcoming = None

    def _next_index(self) -> int:
        return self._pending[-1].index + 1

    def _next_prompts(self) -> list[str] | None:
        batch = next(self._upcoming, None)
        return None if batch is None else list(batch["prompt_text"])

    def _submit(self, index: int, prompts: list[str] | None) -> None:
        if prompts is None:
            raise RuntimeError("rollout.max_staleness > 0: the second pass over the train loader ended before "
                               "the batch Lightning handed the module")
        self.worker.submit(index, prompts, num_generations=self.num_generations, seed=self._seed_of(index))
        self._pending.append(_Request(index, prompts))

    def _drop_pending(self) -> None:
        while self._pending:
            self.worker.drop(self._pending.popleft().index)


def trained_weights(policy: nn.Module, *, trainable_only: bool) -> dict[str, torch.Tensor]:
    """The policy's weights by name, whole (an FSDP2 shard is gathered: a collective, every
    rank calls this); ``trainable_only``: those autograd trains (LoGRA's targets are frozen
    for autograd and travel as low-rank updates)."""
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
            for name, p in policy.named_parameters() if p.requires_grad or not trainable_only}


def steps_done(trainer) -> int:
    """Training steps (prompt batches) before the current one: Lightning's count of completed
    batches, which its checkpoints save and restore."""
    return trainer.fit_loop.epoch_loop.batch_progress.total.completed


def last_step(trainer, index: int, updates_per_step: int) -> int | None:
    """The index of the run's last training step where ``max_steps`` (optimizer steps) fixes
    it, seen from step ``index``; skipped updates may add steps, which are then sampled
    without a head start. None without ``max_steps``."""
    if trainer.max_steps < 0:
        return None
    return index + -(-(trainer.max_steps - trainer.global_step) // updates_per_step) - 1
