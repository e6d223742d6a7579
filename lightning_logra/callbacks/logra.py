"""LoGRACallback: the predicted-KL controller and LoGRA's metrics, for the Trainer.

The strategy calls ``choose_alpha`` after backward and before the update, and
``after_update`` right after it; the metrics are logged at the end of the batch, where
Lightning allows logging. The math is in ``lightning_logra.kl``.
"""

from __future__ import annotations

import resource
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_logra.kl import (
    effective_budget,
    kl_step_scale,
    measured_kl,
    mismatch_sums,
    observed_mismatch_from_sums,
    probe_predicted_kl,
    scheduled_budget,
    update_mismatch,
)
from lightning_logra.memory import memory_report
from lightning_logra.optimizer import LoGRAOptimizer

MIB = 2**20
PROGRESS_BAR_KEYS = ("logra/predicted_kl", "logra/predicted_kl_scaled", "logra/alpha")


class LoGRACallback(Callback):
    """Scales every LoGRA step to the KL budget and logs what it did.

    Probe data: ``pl_module.logra_probe_batch()`` if defined (a dict with ``input_ids``,
    ``attention_mask`` and ``logits_mask``), else the current training batch's
    ``input_ids``/``attention_mask``. Mismatch subtraction uses
    ``pl_module.logra_logprob_pairs()`` -> (rollout log-probs, trainer log-probs, mask of
    EOS-terminated completion tokens) when the module defines it.

    With ``measure_kl=True`` the probe's logits are recomputed after the update and the
    exact KL is logged as ``logra/measured_kl`` beside the prediction.
    """

    def __init__(self, measure_kl: bool = False, log_memory: bool = True, position_chunk: int = 128) -> None:
        self.measure_kl = measure_kl
        self.log_memory = log_memory
        self.position_chunk = position_chunk
        self._module: Any = None
        self._batch: Any = None
        self._metrics: dict[str, float] = {}
        self._probe: dict[str, torch.Tensor] | None = None
        self._logits_before: torch.Tensor | None = None
        self._state_mib: tuple[float, float] | None = None

    # Lightning hooks ------------------------------------------------------------------
    def setup(self, trainer, pl_module, stage: str) -> None:
        self._module = pl_module

    def on_train_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int) -> None:
        self._batch = batch

    def on_train_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int) -> None:
        runtime = getattr(trainer.strategy, "runtime", None)
        if runtime is not None and (self._metrics or runtime.skipped_steps):
            self._metrics["logra/skipped_steps"] = float(runtime.skipped_steps)
        if not self._metrics:
            return
        for key, value in self._metrics.items():
            pl_module.log(key, value, on_step=True, on_epoch=False, prog_bar=key in PROGRESS_BAR_KEYS, batch_size=1)
        self._metrics = {}

    # Called by the strategy ------------------------------------------------------------
    def choose_alpha(self, optimizer: LoGRAOptimizer, policy: nn.Module) -> float:
        config = optimizer.config
        budget = scheduled_budget(config, optimizer.update_count)
        if config.mismatch_subtraction and hasattr(self._module, "logra_logprob_pairs"):
            pairs = self._module.logra_logprob_pairs()
            if pairs is not None:
                sums = mismatch_sums(*pairs)
                _all_reduce(sums)
                optimizer.mismatch = update_mismatch(
                    optimizer.mismatch, observed_mismatch_from_sums(sums), ema_weight=config.mismatch_ema_weight
                )
            budget = effective_budget(budget, optimizer.mismatch, floor=config.mismatch_budget_floor)

        self._probe = self._probe_batch(config.probe_responses, config.probe_max_tokens)
        prediction = probe_predicted_kl(
            policy,
            optimizer.probe_layers(),
            **self._probe,
            temperature=config.temperature,
            position_chunk=self.position_chunk,
            distributed=dist.is_available() and dist.is_initialized(),
        )
        alpha = kl_step_scale(prediction, budget=budget, alpha_max=config.alpha_max)
        if self.measure_kl:
            self._logits_before = _probe_logits(policy, self._probe)
        self._metrics = {
            "logra/predicted_kl": prediction,
            "logra/predicted_kl_scaled": alpha**2 * prediction,
            "logra/alpha": alpha,
            "logra/budget": budget,
            "logra/mismatch": optimizer.mismatch,
            "logra/sketch_norm": optimizer.prepared.sketch_norm,
        }
        return alpha

    def after_update(self, optimizer: LoGRAOptimizer, policy: nn.Module) -> None:
        if self.measure_kl and self._logits_before is not None:
            after = _probe_logits(policy, self._probe)
            sums = torch.stack([
                measured_kl(self._logits_before, after, temperature=optimizer.config.temperature, mask=self._probe["logits_mask"])
                * self._probe["logits_mask"].sum(),
                self._probe["logits_mask"].sum().to(torch.float64),
            ])
            _all_reduce(sums)
            self._metrics["logra/measured_kl"] = float(sums[0] / sums[1])
            self._logits_before = None
        if self.log_memory:
            self._metrics.update(self._memory_metrics(optimizer, policy))

    # Helpers ---------------------------------------------------------------------------
    def _probe_batch(self, responses: int, max_tokens: int) -> dict[str, torch.Tensor]:
        if hasattr(self._module, "logra_probe_batch"):
            probe = self._module.logra_probe_batch()
        else:
            probe = _probe_from_training_batch(self._batch)
        missing = {"input_ids", "attention_mask", "logits_mask"} - set(probe)
        if missing:
            raise ValueError(f"LoGRA probe batch lacks {sorted(missing)}")
        keys = ("input_ids", "attention_mask", "logits_mask", "position_ids")
        return {key: probe[key][:responses, :max_tokens] for key in keys if key in probe}

    def _memory_metrics(self, optimizer: LoGRAOptimizer, policy: nn.Module) -> dict[str, float]:
        if self._state_mib is None:
            world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
            compute = next(iter(optimizer.sketches)).projection.dtype
            report = memory_report(policy, optimizer.config, world_size=world, compute_dtype=compute,
                                   sketch_reduction=optimizer.reduction)
            self._state_mib = (report.logra_state_bytes / MIB, report.dense_adamw_bytes / MIB)
        metrics = {"memory/logra_state_mib": self._state_mib[0], "memory/dense_equivalent_mib": self._state_mib[1]}
        if torch.cuda.is_available():
            metrics["memory/peak_allocated_mib"] = torch.cuda.max_memory_allocated() / MIB
            metrics["memory/peak_reserved_mib"] = torch.cuda.max_memory_reserved() / MIB
        else:
            metrics["memory/peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return metrics


def _probe_from_training_batch(batch: Any) -> dict[str, torch.Tensor]:
    if not isinstance(batch, dict) or "input_ids" not in batch:
        raise ValueError(
            "LoGRACallback needs probe data: define logra_probe_batch() on the LightningModule, or use "
            "training batches that are dicts with 'input_ids' (and 'attention_mask')"
        )
    input_ids = batch["input_ids"]
    attention_mask = batch.get("attention_mask", torch.ones_like(input_ids))
    real = attention_mask.bool()
    logits_mask = torch.zeros_like(real)
    logits_mask[:, :-1] = real[:, :-1] & real[:, 1:]  # position t predicts token t + 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "logits_mask": logits_mask}


@torch.no_grad()
def _probe_logits(policy: nn.Module, probe: dict[str, torch.Tensor]) -> torch.Tensor:
    was_training = policy.training
    policy.eval()
    try:
        output = policy(**{key: value for key, value in probe.items() if key != "logits_mask"})
    finally:
        policy.train(was_training)
    return (output.logits if hasattr(output, "logits") else output).float()


def _all_reduce(tensor: torch.Tensor) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor)
