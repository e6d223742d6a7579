"""LoGRA's runtime in a strategy: the precision it computes in, installing its optimizer,
one update per optimizer step with the inputs handed down with it (``hooks.py``), and
saving / restoring its state. No algorithm lives here: one ``LoGRAOptimizer.step`` call
does the update."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_logra.core.config import LoGRAConfig
from lightning_logra.core.optimizer import LoGRAOptimizer
from lightning_logra.core.reliability import verify_ranks_agree
from lightning_logra.core.report import StepReport
from lightning_logra.core.step_inputs import LoGRAStepInputs
from lightning_logra.hooks import found_hooks
from lightning_logra.strategies.checkpoints import logra_state
from lightning_logra.strategies.sharding import policy_module

REFUSED_PRECISIONS = ("16-mixed", "16", "16-true", "transformer-engine", "transformer-engine-float16")


def compute_dtype_for(precision: str) -> torch.dtype | None:
    precision = str(precision)
    if precision in REFUSED_PRECISIONS:
        raise ValueError(
            f"precision={precision!r} is not supported by LoGRA: a float16 loss scaler would scale the "
            "sketches, and float16 master weights lose updates. Use 'bf16-mixed' (GPU) or '32-true'."
        )
    if precision.startswith("bf16"):
        return torch.bfloat16
    return None


class LoGRARuntime:
    """Owns a strategy's LoGRA optimizer: installs it, runs one step per optimizer step
    with the inputs given to that step, and saves / restores its state."""

    def __init__(self, config: LoGRAConfig, *, train_non_targets: bool, measure_kl: bool = False) -> None:
        self.config = config
        self.train_non_targets = train_non_targets
        self.measure_kl = measure_kl
        self.optimizer: LoGRAOptimizer | None = None
        self.base_lr: float | None = None
        self.last_report: StepReport | None = None
        self.hooks: list[str] = []

    def check_hooks(self, module: nn.Module) -> None:
        """Check the module against the hook Protocols once (a misspelt ``logra_*`` method
        raises) and remember which hooks it provides, for the start-up line."""
        self.hooks = found_hooks(module)

    def install(self, root: nn.Module, *, compute_dtype: torch.dtype | None) -> LoGRAOptimizer:
        policy = policy_module(root, self.config.target_modules)
        # Freezes the targets only (after checking them, before changing anything).
        self.optimizer = LoGRAOptimizer(policy, self.config, compute_dtype=compute_dtype, freeze_non_targets=False)
        verify_ranks_agree(self.optimizer.sketches, self.config.to_dict())
        if not self.train_non_targets:
            for parameter in root.parameters():
                parameter.requires_grad_(False)
        rank_zero_info(self.describe(root))
        return self.optimizer

    def trained_parameters(self) -> int:
        """Parameters LoGRA trains (frozen for autograd, updated through their sketches)."""
        return sum(state.weight.numel() for state in self._require_optimizer().sketches)

    def describe(self, root: nn.Module) -> str:
        """One line: what LoGRA trains, what stays frozen, whether FSDP2 shards the policy."""
        sketches = self._require_optimizer().sketches
        trained = self.trained_parameters()
        others = sum(p.numel() for p in root.parameters()) - trained
        fate = "trained by your optimizer" if self.train_non_targets else "frozen"
        hooks = f"module hooks: {', '.join(self.hooks)}" if self.hooks else "no module hooks (defaults)"
        return (
            f"LoGRA trains {trained:,} parameters in {len(sketches)} target layers "
            f"({', '.join(self.config.target_modules)}) through rank-{sketches.rank} sketches; "
            f"the other {others:,} parameters are {fate}; {self._sharding()}; {hooks}"
        )

    def _sharding(self) -> str:
        """Read from the target weights themselves: plain tensors or FSDP2 shards."""
        group = self._require_optimizer().layout.weight_group
        if group is None:
            return "one device: the policy is not wrapped in FSDP2"
        return f"FSDP2 shards the policy over {dist.get_world_size(group)} ranks"

    def remember_base_lr(self, user_optimizers: list[torch.optim.Optimizer]) -> None:
        """The user's initial learning rate, for ``follow_lr_schedule``."""
        if user_optimizers:
            group = user_optimizers[0].param_groups[0]
            self.base_lr = float(group.get("initial_lr", group["lr"]))

    def step(
        self,
        user_optimizer: torch.optim.Optimizer | None,
        inputs: LoGRAStepInputs,
        *,
        process_group: dist.ProcessGroup | None,
        allow_no_backward: bool = False,
    ) -> StepReport | None:
        """The core's one-call update with the inputs the caller handed down. A skipped step
        also clears the user's gradients."""
        optimizer = self._require_optimizer()
        if self.config.follow_lr_schedule and user_optimizer is not None and self.base_lr:
            lr = float(user_optimizer.param_groups[0]["lr"])
            optimizer.param_groups[0]["lr"] = self.config.update_ratio * lr / self.base_lr
        report = optimizer.step(logra_inputs=inputs, process_group=process_group, measure_kl=self.measure_kl,
                                allow_no_backward=allow_no_backward)
        if report is not None and report.skipped and user_optimizer is not None:
            user_optimizer.zero_grad(set_to_none=True)
        self.last_report = report
        return report

    # Checkpoints: LoGRA's state is <checkpoint>/logra/state.safetensors (``logra_state``),
    # the same for Trainer and Fabric; reading it unpickles nothing.
    def save_state(self, folder: Path, *, rank: int) -> None:
        logra_state.write_state(folder, self._require_optimizer().state_dict(), rank=rank)

    def read_state(self, folder: Path) -> dict[str, Any]:
        """LoGRA's saved state, checked against this run (a structural mismatch raises
        here, before the caller loads any other state). Nothing is applied yet."""
        state = logra_state.read_state(folder, self._require_optimizer().state_dict())
        self.optimizer.check_state(state)
        return state

    def load_state(self, state: dict[str, Any]) -> None:
        self._require_optimizer().load_state_dict(state)

    def _require_optimizer(self) -> LoGRAOptimizer:
        if self.optimizer is None:
            raise RuntimeError("LoGRA is not installed yet: the strategy's setup has not run")
        return self.optimizer


class LoGRARuntimeMixin:
    """What both strategy classes expose of LoGRA: its configuration, the runtime, the
    optimizer and the last step's report (for observers; a step returns its own)."""

    def _init_runtime(self, logra: LoGRAConfig | None, train_non_targets: bool, measure_kl: bool = False) -> None:
        self.logra_config = logra if logra is not None else LoGRAConfig()
        self.runtime = LoGRARuntime(self.logra_config, train_non_targets=train_non_targets, measure_kl=measure_kl)

    @property
    def logra_optimizer(self) -> LoGRAOptimizer | None:
        return self.runtime.optimizer

    @property
    def last_report(self) -> StepReport | None:
        """What the last LoGRA step did (``report.metrics()`` for a logger)."""
        return self.runtime.last_report
