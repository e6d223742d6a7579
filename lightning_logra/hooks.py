"""The contract between a LightningModule and the ``logra_fsdp`` strategies.

Data goes one way. The module hands each step its inputs and gets back what the step did:

    report = self.optimizers().step(logra_inputs=LoGRAStepInputs(probe=..., ...))  # StepReport

(Lightning passes the keyword through to the strategy's ``optimizer_step``; with Fabric,
``fabric.strategy.logra_step(optimizer, logra_inputs)``.) A step given no inputs, as under
automatic optimization, probes the training batch when it is a dict with ``input_ids``
(every next-token position), with no log-prob pairs and a mean loss; given inputs without a
probe, it probes that batch too.

A module may provide two hooks, each a small runtime-checkable Protocol that the strategy
checks once, at setup, saying which it found:

- ``logra_model()``: the module LoGRA trains (default: the only child holding targets).
- ``logra_frozen_models()``: models beside it that get no gradient (e.g. a KL reference),
  kept in the compute dtype and sharded like the policy.

A method named ``logra_*`` that is no hook is refused at setup, so a misspelt hook never
silently does nothing; so is ``logra_step_inputs()``, which the strategy used to call
back during a step (its message says what replaced it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from torch import nn

from lightning_logra.core.optimizer import LoGRAOptimizer
from lightning_logra.core.probe import ProbeBatch
from lightning_logra.core.report import StepReport
from lightning_logra.core.step_inputs import LoGRAStepInputs

__all__ = ["LoGRAModuleHooks", "LoGRAStepInputs", "ProvidesFrozenModels", "ProvidesLoGRAModel", "ReportsLoGRASteps",
           "found_hooks", "with_default_probe"]


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
class LoGRAModuleHooks(ProvidesLoGRAModel, ProvidesFrozenModels, Protocol):
    """Every hook: what ``GRPOModule`` provides."""


HOOKS: dict[str, type] = {
    "logra_model": ProvidesLoGRAModel,
    "logra_frozen_models": ProvidesFrozenModels,
}
# Hooks of earlier versions -> what replaced them, for the error that refuses them.
REMOVED_HOOKS: dict[str, str] = {
    "logra_step_inputs": (
        "the step's inputs now go down with the step: report = self.optimizers().step(logra_inputs="
        "LoGRAStepInputs(...)) in a LightningModule, fabric.strategy.logra_step(optimizer, LoGRAStepInputs(...)) "
        "in a Fabric loop"
    ),
}


@runtime_checkable
class ReportsLoGRASteps(Protocol):
    """What both ``logra_fsdp`` strategies offer: optimizer steps that take
    ``logra_inputs=``, the ``StepReport`` of the last step (for observers such as
    ``LoGRACallback``; the module gets it back from its step) and the ``LoGRAOptimizer``
    itself (None before setup)."""

    @property
    def last_report(self) -> StepReport | None: ...

    @property
    def logra_optimizer(self) -> LoGRAOptimizer | None: ...


def found_hooks(module: Any) -> list[str]:
    """The hooks ``module`` provides, in ``HOOKS`` order. A ``logra_*`` method that is no
    hook (a misspelling, or a hook of an older version) raises ``TypeError`` naming it."""
    names = [name for name in dir(type(module))
             if name.startswith("logra_") and name not in HOOKS and callable(getattr(type(module), name, None))]
    removed = [f"{name}() was removed: {REMOVED_HOOKS[name]}" for name in sorted(names) if name in REMOVED_HOOKS]
    if removed:
        raise TypeError(f"{type(module).__name__} defines " + "; ".join(removed))
    if names:
        raise TypeError(
            f"{type(module).__name__} defines {', '.join(sorted(names))}, which is no LoGRA hook; the hooks are "
            f"{', '.join(HOOKS)} (lightning_logra.hooks). Rename or remove it: a misspelt hook would do nothing"
        )
    return [name for name, protocol in HOOKS.items() if isinstance(module, protocol)]


def with_default_probe(inputs: LoGRAStepInputs | None, batch: Any) -> LoGRAStepInputs:
    """The step's inputs as the strategy runs them: ``inputs`` (none: the defaults), probing
    the training ``batch`` when they name no probe and it is a dict with ``input_ids``."""
    if inputs is None:
        inputs = LoGRAStepInputs()
    elif not isinstance(inputs, LoGRAStepInputs):
        raise TypeError(f"optimizer.step(logra_inputs=...) takes a LoGRAStepInputs, got {type(inputs).__name__}")
    if inputs.probe is None and isinstance(batch, Mapping) and "input_ids" in batch:
        probe = ProbeBatch.from_token_batch(batch["input_ids"], batch.get("attention_mask"))
        return LoGRAStepInputs(probe, inputs.logprob_pairs, inputs.normalization_tokens, inputs.record_low_rank)
    return inputs
