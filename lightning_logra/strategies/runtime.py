"""What the Trainer and Fabric strategies share: FSDP2 sharding (across ranks only),
LoGRA installation, fetching the step's inputs from the module once (``hooks.py``), and
checkpoint folders with LoGRA's state. No algorithm lives here: one ``LoGRAOptimizer.step``
call does the update."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import nn
from transformers import PreTrainedModel

from lightning_logra.core.config import LoGRAConfig
from lightning_logra.core.optimizer import LoGRAOptimizer
from lightning_logra.core.reliability import verify_ranks_agree
from lightning_logra.core.report import StepReport
from lightning_logra.core.sketch import is_target_name
from lightning_logra.hooks import ProvidesFrozenModels, ProvidesLoGRAModel, found_hooks, step_inputs
from lightning_logra.models.sharded_loading import is_empty, materialize
from lightning_logra.notices import quiet_lightning_pytree_notice
from lightning_logra.strategies import atomic, logra_state, writer_lock
from lightning_logra.strategies.checkpoint import (
    load_folder,
    require_folder,
    save_folder,
)

REFUSED_PRECISIONS = ("16-mixed", "16", "16-true", "transformer-engine", "transformer-engine-float16")


def policy_module(root: nn.Module, target_modules: list[str]) -> nn.Module:
    """The module LoGRA trains: ``root.logra_model()`` if defined, else the only direct
    child that holds targets (the HF model of a LightningModule), else ``root`` itself."""
    if isinstance(root, ProvidesLoGRAModel):
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
    """Owns a strategy's LoGRA optimizer: installs it, runs one step per optimizer step
    with what the module offers, and saves / restores its state."""

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
        module: nn.Module,
        user_optimizer: torch.optim.Optimizer | None,
        *,
        batch: Any,
        process_group: dist.ProcessGroup | None,
        allow_no_backward: bool = False,
    ) -> StepReport | None:
        """Ask the module for this step's inputs once (``hooks.step_inputs``) and run the
        core's one-call update. A skipped step also clears the user's gradients."""
        optimizer = self._require_optimizer()
        if self.config.follow_lr_schedule and user_optimizer is not None and self.base_lr:
            lr = float(user_optimizer.param_groups[0]["lr"])
            optimizer.param_groups[0]["lr"] = self.config.update_ratio * lr / self.base_lr
        inputs = step_inputs(module, batch)
        report = optimizer.step(
            probe=inputs.probe,
            logprob_pairs=inputs.logprob_pairs,
            normalization_tokens=inputs.normalization_tokens,
            process_group=process_group,
            measure_kl=self.measure_kl,
            allow_no_backward=allow_no_backward,
            record_low_rank=inputs.record_low_rank,
        )
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


class LoGRAStrategyMixin:
    """What both strategy classes add to their Lightning base: the LoGRA configuration and
    runtime, data-parallel-only sizing, FSDP2 sharding of the policy across two or more
    ranks (none on one device), atomic checkpoint folders that hold LoGRA's state."""

    def _init_logra(self, logra: LoGRAConfig | None, train_non_targets: bool, layer_classes: list[str] | None,
                    checkpoint_lock_lease_s: float, measure_kl: bool = False) -> None:
        self.logra_config = logra if logra is not None else LoGRAConfig()
        self.layer_classes = layer_classes
        self.checkpoint_lock_lease_s = writer_lock.check_lease(checkpoint_lock_lease_s, type(self).__name__)
        self.runtime = LoGRARuntime(self.logra_config, train_non_targets=train_non_targets, measure_kl=measure_kl)
        self._held_folders: set[Path] = set()  # rank 0's writer locks, released at teardown

    @property
    def logra_optimizer(self) -> LoGRAOptimizer | None:
        return self.runtime.optimizer

    @property
    def last_report(self) -> StepReport | None:
        """What the last LoGRA step did (``report.metrics()`` for a logger)."""
        return self.runtime.last_report

    def setup_environment(self) -> None:
        quiet_lightning_pytree_notice()
        # Data-parallel only: every process is one data-parallel rank (one FSDP2 shard when several).
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    def _shards_policy(self) -> bool:
        """FSDP2 pays off across ranks only: on one device it shards nothing, and its hooks
        all-gather (copy) each block's weights at every module call, every decoding step
        of a rollout included."""
        return self.device_mesh["data_parallel"].size() > 1

    def _shard(self, module: nn.Module, mesh: Any) -> nn.Module:
        """The policy, and the frozen models the module names (``logra_frozen_models()``, e.g.
        a KL reference), FSDP2-sharded across ranks; the frozen ones also cast to the compute
        dtype: they get no gradient, so a float32 master copy would only cost memory."""
        frozen = list(module.logra_frozen_models()) if isinstance(module, ProvidesFrozenModels) else []
        compute_dtype = self._compute_dtype()
        for model in frozen:
            if compute_dtype is not None:
                model.to(compute_dtype)
        if self._shards_policy():
            policy = policy_module(module, self.logra_config.target_modules)
            for model in (policy, *frozen):
                shard_policy(model, mesh["data_parallel"], self.logra_config.target_modules, self.layer_classes)
        self._materialize_pretrained(module)
        return module

    def _materialize_pretrained(self, module: nn.Module) -> None:
        """Storage for the Hugging Face models built empty (meta device): each rank reads its
        own rows from the model's safetensors files, in the dtype set above (a model built
        from a config gets its own random initialisation). Lightning materialises any other
        empty module afterwards (``reset_parameters``)."""
        for model in module.modules():  # an outer model first: its inner models are filled with it
            if isinstance(model, PreTrainedModel) and is_empty(model):
                materialize(model, self.root_device)

    def _data_parallel_group(self) -> dist.ProcessGroup:
        return self.device_mesh["data_parallel"].get_group()

    def _save_folder(self, path: Any, tensors: dict[str, Any], metadata: dict[str, Any]) -> None:
        """The checkpoint folder at ``path``: shards of ``tensors`` (state dicts),
        ``metadata`` and LoGRA's state, written atomically."""

        def write(folder: Path) -> None:
            save_folder(folder, tensors, metadata, rank=self.global_rank)
            self.runtime.save_state(folder, rank=self.global_rank)

        self._write_atomically(path, write)

    def _load_folder(self, path: Any, state: dict[str, Any], *, strict: bool, weights_only: bool | None) -> dict[str, Any]:
        """Restore ``state`` and LoGRA from the folder at ``path`` (first finishing what a
        crash left of its save, unless another live run holds that folder: then nothing is
        left to finish); return the metadata that ``state`` did not ask for."""
        path = Path(self.broadcast(path))
        self._on_rank_zero(writer_lock.recover_if_free, path.parent, lambda _: atomic.recover(path))
        owner = type(self).__name__
        require_folder(path, owner)
        logra_state = self.runtime.read_state(path)  # a structural mismatch fails before any state is loaded
        remaining = load_folder(path, state, strict=strict, weights_only=weights_only, owner=owner)
        self.runtime.load_state(logra_state)
        return remaining

    def _hold_folder(self, folder: Path) -> writer_lock.WriterLock:
        """Rank 0: the writer lock of ``folder`` (``writer_lock.hold``), kept until teardown."""
        lock = writer_lock.hold(folder, self.checkpoint_lock_lease_s)
        self._held_folders.add(Path(folder))
        return lock

    def remove_checkpoint(self, filepath: Any) -> None:
        """ModelCheckpoint deletes superseded checkpoints through this: renamed away first,
        so a crash never leaves a half-deleted folder under a checkpoint's name."""
        self._on_rank_zero(atomic.remove, Path(filepath))

    def teardown(self) -> None:
        self._release_writer_locks()
        super().teardown()

    def _release_writer_locks(self) -> None:
        for folder in self._held_folders:
            writer_lock.release(folder)
        self._held_folders.clear()

    def _write_atomically(self, path: Any, write: Callable[[Path], None]) -> None:
        """``write`` fills a hidden partial folder, put in place once every rank has
        finished and rank 0 has marked it complete (the steps of ``atomic``)."""
        path = Path(self.broadcast(path))
        self._on_rank_zero(self._prepare_save, path)
        partial = atomic.partial_path(path)
        write(partial)
        self.barrier()
        self._on_rank_zero(atomic.commit, partial, path)

    def _prepare_save(self, path: Path) -> None:
        """One writer per folder: the lock (held since start-up for the folders the run
        was set up to write, else taken now) still ours; then the leftovers of an
        interrupted save of ``path`` dealt with."""
        self._hold_folder(path.parent).renew()  # raises if another run took the lock over meanwhile
        atomic.prepare(path)

    def _on_rank_zero(self, operation: Callable[..., Any], *args: Any) -> None:
        """Run a file operation on rank 0 and raise its error on every rank (no rank is
        left waiting at a barrier); the other ranks go on once it is done."""
        error = None
        if self.global_rank == 0:
            try:
                operation(*args)
            except (OSError, RuntimeError, ValueError) as raised:
                error = raised
        error = self.broadcast(error)
        if error is not None:
            raise error
