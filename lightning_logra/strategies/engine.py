"""What the Trainer and Fabric strategies share: FSDP2 sharding, LoGRA installation, the
per-step update, and LoGRA's part of a distributed checkpoint. No algorithm lives here;
it calls the plain-torch core."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from lightning_logra.config import LoGRAConfig
from lightning_logra.optimizer import LoGRAOptimizer
from lightning_logra.reliability import memory_phase, verify_ranks_agree
from lightning_logra.sketch import is_target_name

REFUSED_PRECISIONS = ("16-mixed", "16", "16-true", "transformer-engine", "transformer-engine-float16")


class KLController(Protocol):
    """Chooses the step scale alpha for a prepared update (LoGRACallback implements it)."""

    def choose_alpha(self, optimizer: LoGRAOptimizer, policy: nn.Module) -> float: ...

    def after_update(self, optimizer: LoGRAOptimizer, policy: nn.Module) -> None: ...


def policy_module(root: nn.Module, target_modules: list[str]) -> nn.Module:
    """The module LoGRA trains: ``root.logra_model()`` if defined, else the only direct
    child that holds targets (the HF model of a LightningModule), else ``root`` itself."""
    if hasattr(root, "logra_model"):
        return root.logra_model()
    holders = [child for name, child in root.named_children() if _holds_target(name, child, target_modules)]
    return holders[0] if len(holders) == 1 else root


def shard_policy(policy: nn.Module, mesh: Any, target_modules: list[str], layer_classes: list[str] | None = None) -> None:
    """FSDP2-shard the transformer blocks, then the model that holds them.

    Blocks are the classes named in ``layer_classes``, else the HF ``_no_split_modules`` of
    the policy, else the entries of any ``nn.ModuleList``. The called model is sharded, not
    a LightningModule: if the policy is the LightningModule itself, its children that hold
    targets are. A policy already holding FSDP2 modules (sharded by the user in
    ``configure_model``) is left as it is.
    """
    import lightning.pytorch as pl
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if any(isinstance(module, FSDPModule) for module in policy.modules()):
        return
    names = set(layer_classes or getattr(policy, "_no_split_modules", None) or [])
    if names:
        blocks = [m for m in policy.modules() if type(m).__name__ in names]
    else:
        blocks = [m for lst in policy.modules() if isinstance(lst, nn.ModuleList) for m in lst]
    for block in blocks:
        fully_shard(block, mesh=mesh)
    if isinstance(policy, pl.LightningModule):
        for name, child in policy.named_children():
            if _holds_target(name, child, target_modules) and not isinstance(child, FSDPModule):
                fully_shard(child, mesh=mesh)
    else:
        fully_shard(policy, mesh=mesh)


def _holds_target(name: str, module: nn.Module, target_modules: list[str]) -> bool:
    """Whether the child ``name`` is a target or contains one."""
    return any(is_target_name(sub or name, target_modules) for sub, _ in module.named_modules())


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
    """Owns the LoGRA optimizer of a strategy and runs one update per optimizer step."""

    def __init__(self, config: LoGRAConfig, *, train_non_targets: bool) -> None:
        self.config = config
        self.train_non_targets = train_non_targets
        self.optimizer: LoGRAOptimizer | None = None
        self.policy: nn.Module | None = None
        self.controller: KLController | None = None
        self.base_lr: float | None = None
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self._warned_uncontrolled = False

    def install(self, root: nn.Module, *, compute_dtype: torch.dtype | None) -> LoGRAOptimizer:
        self.policy = policy_module(root, self.config.target_modules)
        # Freezes the targets only (after checking them, before changing anything).
        self.optimizer = LoGRAOptimizer(self.policy, self.config, compute_dtype=compute_dtype, freeze_non_targets=False)
        verify_ranks_agree(self.optimizer.sketches, self.config.to_dict())
        if not self.train_non_targets:
            for parameter in root.parameters():
                parameter.requires_grad_(False)
        return self.optimizer

    def remember_base_lr(self, user_optimizers: list[torch.optim.Optimizer]) -> None:
        """The user's initial learning rate: LoGRA's step is update_ratio x lr / initial lr,
        so the user's scheduler shapes LoGRA's steps (warm-up, decay)."""
        if user_optimizers:
            group = user_optimizers[0].param_groups[0]
            self.base_lr = float(group.get("initial_lr", group["lr"]))

    def update(
        self,
        user_optimizer: torch.optim.Optimizer | None,
        *,
        normalization_tokens: float,
        process_group: dist.ProcessGroup | None,
        backward_ran: Callable[[], bool] | None = None,
    ) -> bool:
        """Reduce sketches, choose alpha, apply. Returns False (nothing done) when no
        backward ran on any rank and ``backward_ran`` says skipping is allowed."""
        optimizer = self._require_optimizer()
        if backward_ran is not None and not backward_ran():
            optimizer.skip_update()
            return False
        if user_optimizer is not None and self.base_lr:
            lr = float(user_optimizer.param_groups[0]["lr"])
            optimizer.param_groups[0]["lr"] = self.config.update_ratio * lr / self.base_lr
        try:
            with memory_phase("update"):
                optimizer.prepare_update(normalization_tokens=normalization_tokens, process_group=process_group)
            with memory_phase("probe"):
                alpha = self._alpha(optimizer)
            with memory_phase("update"):
                optimizer.step(alpha=alpha)
        except FloatingPointError as error:
            # Sketch flags, the probe and alpha are reduced across ranks, so every rank
            # lands here together and stays consistent.
            if self.config.on_nonfinite == "raise":
                raise
            self._skip(optimizer, user_optimizer, error)
            return False
        self.consecutive_skips = 0
        if self.controller is not None:
            self.controller.after_update(optimizer, self.policy)
        return True

    def _alpha(self, optimizer: LoGRAOptimizer) -> float:
        if self.controller is not None:
            return self.controller.choose_alpha(optimizer, self.policy)
        if not self._warned_uncontrolled:
            warnings.warn(
                "LoGRA is stepping without KL control (alpha = 1): add lightning_logra.LoGRACallback() "
                "to the Trainer's callbacks to scale every step to the KL budget",
                stacklevel=3,
            )
            self._warned_uncontrolled = True
        return 1.0

    def _skip(self, optimizer: LoGRAOptimizer, user_optimizer: torch.optim.Optimizer | None, error: Exception) -> None:
        """No weight changes: sketches dropped, the user's optimizer sees no gradients."""
        optimizer.skip_update()
        if user_optimizer is not None:
            user_optimizer.zero_grad(set_to_none=True)
        self.skipped_steps += 1
        self.consecutive_skips += 1
        if self.consecutive_skips >= self.config.max_consecutive_skips:
            raise FloatingPointError(
                f"LoGRA skipped {self.consecutive_skips} consecutive steps with non-finite values "
                f"(max_consecutive_skips={self.config.max_consecutive_skips}); last: {error}"
            ) from error
        warnings.warn(f"LoGRA skipped a step ({self.skipped_steps} so far, no weight changed): {error}", stacklevel=3)

    def any_backward(self, process_group: dist.ProcessGroup | None) -> bool:
        distributed = dist.is_available() and dist.is_initialized()
        return bool(self._require_optimizer().backward_calls(process_group if distributed else None).any())

    # Checkpoints: tensors (row moments may be DTensors) go through torch.distributed.checkpoint;
    # the configuration goes into the rank-0 metadata so that a mismatch is caught first.
    def checkpoint_tensors(self) -> dict[str, Any]:
        state = self._require_optimizer().state_dict()
        return {
            "second_moments": state["second_moments"],
            "update_count": torch.tensor([state["update_count"]], dtype=torch.int64),
            "mismatch": torch.tensor([state["mismatch"]], dtype=torch.float64),
            "lr": torch.tensor([state["param_groups"][0]["lr"]], dtype=torch.float64),
        }

    def checkpoint_metadata(self) -> dict[str, Any]:
        optimizer = self._require_optimizer()
        return {"logra_config": self.config.to_dict(), "layers": [s.name for s in optimizer.sketches]}

    def check_metadata(self, metadata: dict[str, Any] | None) -> None:
        if metadata is None:
            raise ValueError("checkpoint has no LoGRA state: it was not written by a LoGRA strategy")
        mismatches = self.config.structural_mismatches(metadata["logra_config"])
        if mismatches:
            raise ValueError("checkpoint was written with another LoGRA configuration: " + "; ".join(mismatches))

    def load_checkpoint_tensors(self, tensors: dict[str, Any], metadata: dict[str, Any]) -> None:
        self._require_optimizer().load_state_dict(
            {
                **metadata,
                "second_moments": tensors["second_moments"],
                "update_count": int(tensors["update_count"].item()),
                "mismatch": float(tensors["mismatch"].item()),
                "param_groups": [{"lr": float(tensors["lr"].item())}],
            }
        )

    def _require_optimizer(self) -> LoGRAOptimizer:
        if self.optimizer is None:
            raise RuntimeError("LoGRA is not installed yet: the strategy's setup has not run")
        return self.optimizer


class LoGRAStrategyMixin:
    """What both strategy classes add to their Lightning base: the LoGRA configuration and
    runtime, data-parallel-only sizing, and FSDP2 sharding of the policy."""

    def _init_logra(self, logra: LoGRAConfig | None, train_non_targets: bool, layer_classes: list[str] | None) -> None:
        self.logra_config = logra if logra is not None else LoGRAConfig()
        self.layer_classes = layer_classes
        self.runtime = LoGRARuntime(self.logra_config, train_non_targets=train_non_targets)

    @property
    def logra_optimizer(self) -> LoGRAOptimizer | None:
        return self.runtime.optimizer

    def setup_environment(self) -> None:
        # Data-parallel only: every process is one FSDP2 shard.
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    def _shard(self, module: nn.Module, mesh: Any) -> nn.Module:
        policy = policy_module(module, self.logra_config.target_modules)
        shard_policy(policy, mesh["data_parallel"], self.logra_config.target_modules, self.layer_classes)
        return module


def normalization_tokens_of(module: nn.Module) -> float:
    """``module.logra_normalization_tokens()`` if defined (sum-over-tokens losses), else 1."""
    if hasattr(module, "logra_normalization_tokens"):
        tokens = float(module.logra_normalization_tokens())
        if not math.isfinite(tokens) or tokens <= 0:
            raise ValueError(f"logra_normalization_tokens() returned {tokens}; it must be a count > 0")
        return tokens
    return 1.0
