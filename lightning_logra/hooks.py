"""The contract between a LightningModule and the ``logra_fsdp`` strategies.

A module may provide any of three hooks; each is a small runtime-checkable Protocol, and
the strategy checks the module against them once, at setup, and says which it found:

- ``logra_model()``: the module LoGRA trains (default: the only child holding targets).
- ``logra_frozen_models()``: models beside it that get no gradient (e.g. a KL reference),
  kept in the compute dtype and sharded like the policy.
- ``logra_step_inputs()``: called once per optimizer step, returns one ``LoGRAStepInputs``
  (the probe batch, the log-prob pairs, the normalisation tokens, whether to record the
  low-rank form of the update). Default: the training batch as the probe (a dict with
  ``input_ids``), no pairs, a mean loss.

What an update changed comes back on the step's ``StepReport``
(``StepReport.low_rank_updates``), which ``last_step_report(trainer)`` returns. A method
named ``logra_*`` that is none of these hooks is refused at setup, so a misspelt hook
never silently does nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from torch import nn

from lightning_logra.core.kl import LogprobPairs
from lightning_logra.core.optimizer import LoGRAOptimizer
from lightning_logra.core.probe import ProbeBatch
from lightning_logra.core.report import StepReport


@dataclass(frozen=True)
class LoGRAStepInputs:
    """What one LoGRA step needs from the module, beyond the sketches.

    ``probe``: the responses the KL probe scores (a ``ProbeBatch``, or its dict form), None
    to probe the training batch. ``logprob_pairs``: rollout vs trainer log-probs for the
    mismatch term. ``normalization_tokens``: the global count of loss-bearing tokens when
    the loss is a sum over tokens (1 for a mean loss). ``record_low_rank``: keep the update
    as (alpha D, seed of A) per target on the ``StepReport``, for a low-rank weight sync.
    """

    probe: ProbeBatch | None = None
    logprob_pairs: LogprobPairs | None = None
    normalization_tokens: float = 1.0
    record_low_rank: bool = False

    def __post_init__(self) -> None:
        if self.probe is not None and not isinstance(self.probe, ProbeBatch):
            if not isinstance(self.probe, Mapping):
                raise TypeError(f"LoGRAStepInputs.probe must be a ProbeBatch or a mapping, got {type(self.probe).__name__}")
            object.__setattr__(self, "probe", ProbeBatch.from_mapping(self.probe))
        if self.logprob_pairs is not None and not isinstance(self.logprob_pairs, LogprobPairs):
            object.__setattr__(self, "logprob_pairs", LogprobPairs(*self.logprob_pairs))
        tokens = float(self.normalization_tokens)
        if not math.isfinite(tokens) or tokens <= 0:
            raise ValueError(f"LoGRAStepInputs.normalization_tokens = {self.normalization_tokens!r} must be a count > 0")
        if not isinstance(self.record_low_rank, bool):
            raise TypeError(f"LoGRAStepInputs.record_low_rank must be a bool, got {self.record_low_rank!r}")


@runtime_checkable
class ProvidesLoGRAModel(Protocol):
    def logra_model(self) -> nn.Module:
        """The module LoGRA trains (e.g. the policy when a reference model sits beside it)."""
        ...


@runtime_checkable
class ProvidesFrozenModels(Protocol):
    def logra_frozen_models(self) -> Sequence[nn.Module]:
        """Models that get no gradient: cast to the compute dtype and sharded like the policy."""
        ...


@runtime_checkable
class ProvidesStepInputs(Protocol):
    def logra_step_inputs(self) -> LoGRAStepInputs:
        """This optimizer step's inputs; called once per step, after the backward passes."""
        ...


@runtime_checkable
class LoGRAModuleHooks(ProvidesLoGRAModel, ProvidesFrozenModels, ProvidesStepInputs, Protocol):
    """Every hook: what ``GRPOModule`` provides."""


HOOKS: dict[str, type] = {
    "logra_model": ProvidesLoGRAModel,
    "logra_frozen_models": ProvidesFrozenModels,
    "logra_step_inputs": ProvidesStepInputs,
}


@runtime_checkable
class ReportsLoGRASteps(Protocol):
    """What both ``logra_fsdp`` strategies offer: the ``StepReport`` of the last step, and
    the ``LoGRAOptimizer`` itself (None before setup)."""

    @property
    def last_report(self) -> StepReport | None: ...

    @property
    def logra_optimizer(self) -> LoGRAOptimizer | None: ...


def found_hooks(module: Any) -> list[str]:
    """The hooks ``module`` provides, in ``HOOKS`` order. A ``logra_*`` method that is no
    hook (a misspelling, or a hook of an older version) raises ``TypeError`` naming it."""
    unknown = sorted(
        name for name in dir(type(module))
        if name.startswith("logra_") and name not in HOOKS and callable(getattr(type(module), name, None))
    )
    if unknown:
        raise TypeError(
            f"{type(module).__name__} defines {', '.join(unknown)}, which is no LoGRA hook; the hooks are "
            f"{', '.join(HOOKS)} (lightning_logra.hooks). Rename or remove it: a misspelt hook would do nothing"
        )
    return [name for name, protocol in HOOKS.items() if isinstance(module, protocol)]


def step_inputs(module: Any, batch: Any) -> LoGRAStepInputs:
    """The module's ``logra_step_inputs()``; without it, the training batch as the probe
    when it is a dict with ``input_ids`` (every next-token position), else no probe."""
    if isinstance(module, ProvidesStepInputs):
        inputs = module.logra_step_inputs()
        if not isinstance(inputs, LoGRAStepInputs):
            raise TypeError(f"{type(module).__name__}.logra_step_inputs() returned {type(inputs).__name__}, "
                            "not a LoGRAStepInputs")
        if inputs.probe is not None:
            return inputs
    else:
        inputs = LoGRAStepInputs()
    if isinstance(batch, Mapping) and "input_ids" in batch:
        probe = ProbeBatch.from_token_batch(batch["input_ids"], batch.get("attention_mask"))
        return LoGRAStepInputs(probe, inputs.logprob_pairs, inputs.normalization_tokens, inputs.record_low_rank)
    return inputs


def last_step_report(trainer: Any) -> StepReport | None:
    """The ``StepReport`` of the last optimizer step under a ``logra_fsdp`` strategy; None
    under any other strategy (a dense or LoRA run) or before the first step."""
    strategy = trainer.strategy
    return strategy.last_report if isinstance(strategy, ReportsLoGRASteps) else None
