"""One update of the RL step, the same code for ``GRPOModule`` and the benchmarks: the
micro-batched forward/backward on some rows of a rollout batch, then one optimizer step,
which under LoGRA is handed its inputs and returns its ``StepReport``. Also the AdamW (and
its schedule) that dense and LoRA runs step.

    optimizer = build_optimizer(policy.parameters(), OptimizerConfig())  # dense / LoRA
    update = run_update(policy, optimizer, batch, rows, settings, backward=loss_backward,
                        passes=passes, num_generations=8, logra=False)

Profiler ranges ``rl.forward_backward`` and ``rl.optimizer_step`` mark the two halves
(LoGRA's own ``logra.prepare`` / ``logra.probe`` / ``logra.apply`` sit inside the second).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from lightning_logra.core.report import StepReport
from lightning_logra.core.step_inputs import LoGRAStepInputs
from lightning_logra.rl.batch import MicroBatching, RolloutBatch, backward_micro_batches
from lightning_logra.rl.config import OptimizerConfig, lr_factor
from lightning_logra.rl.logprobs import ForwardDraw
from lightning_logra.rl.metrics import PassTotals

RANGES = {"forward_backward": "rl.forward_backward", "optimizer_step": "rl.optimizer_step"}


@dataclass(frozen=True)
class Update:
    """What one update did: the rows' detached trainer log-probs (before the step), and
    LoGRA's ``StepReport`` (None when the optimizer is AdamW)."""

    trainer_logprobs: torch.Tensor
    report: StepReport | None


def build_optimizer(parameters: Iterable[torch.nn.Parameter], config: OptimizerConfig) -> torch.optim.AdamW:
    """AdamW over the parameters that need a gradient: the whole policy (dense) or the LoRA
    adapters, with ``config``'s lr, betas and weight decay."""
    trainable = [parameter for parameter in parameters if parameter.requires_grad]
    return torch.optim.AdamW(trainable, lr=config.lr, betas=tuple(config.betas), weight_decay=config.weight_decay)


def build_lr_schedule(optimizer: torch.optim.Optimizer, config: OptimizerConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up, then cosine decay (``lr_factor``), stepped once per optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config))


def optimizer_with_schedule(parameters: Iterable[torch.nn.Parameter], config: OptimizerConfig) -> dict:
    """``configure_optimizers``' answer for a module trained by AdamW and its schedule, stepped
    once per optimizer step (the handle of LoGRA's steps under ``logra_fsdp``)."""
    optimizer = build_optimizer(parameters, config)
    scheduler = build_lr_schedule(optimizer, config)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def logra_step_inputs(batch: RolloutBatch, rows: slice, trainer_logprobs: torch.Tensor, settings: MicroBatching, *,
                      num_generations: int, record_low_rank: bool = False) -> LoGRAStepInputs:
    """A LoGRA step's inputs for an update on ``rows``: their responses as the probe batch
    (one per prompt first), their rollout/trainer log-prob pairs at the weights that sampled
    (the old log-probs when the batch has them, else the update's own), a mean loss."""
    sampled = trainer_logprobs if batch.old_logprobs is None else batch.old_logprobs[rows]
    return LoGRAStepInputs(
        probe=batch.probe_batch(rows, num_generations=num_generations, temperature=settings.temperature,
                                packed=settings.micro_batch_tokens is not None),
        logprob_pairs=batch.logprob_pairs(rows, sampled),
        record_low_rank=record_low_rank,
    )


def run_update(policy: torch.nn.Module, optimizer, batch: RolloutBatch, rows: slice, settings: MicroBatching, *,
               backward: Callable[[torch.Tensor], None], passes: PassTotals, num_generations: int, logra: bool,
               world: int = 1, record_low_rank: bool = False,
               after_backward: Callable[[], None] = lambda: None,
               draw_at: Callable[[torch.Tensor], ForwardDraw | None] | None = None) -> Update | None:
    """One optimizer step on ``rows``: zero the gradients, ``backward_micro_batches`` (with
    ``draw_at``: tokens drawn in its forwards), call ``after_backward()``, then
    ``optimizer.step()``; with ``logra``,
    ``optimizer.step(logra_inputs=logra_step_inputs(...))`` (a ``LoGRAOptimizer``, or
    Lightning's optimizer under ``logra_fsdp``), whose report is returned. None, with nothing
    stepped, when no rank has a token to train on in ``rows``."""
    optimizer.zero_grad()
    with record_function(RANGES["forward_backward"]):
        trained = backward_micro_batches(policy, batch, rows, settings, backward=backward, passes=passes, world=world,
                                         draw_at=draw_at)
    if trained is None:
        return None
    after_backward()
    with record_function(RANGES["optimizer_step"]):
        if logra:
            inputs = logra_step_inputs(batch, rows, trained, settings, num_generations=num_generations,
                                       record_low_rank=record_low_rank)
            report = optimizer.step(logra_inputs=inputs)
        else:
            optimizer.step()
            report = None
    return Update(trained, report)
