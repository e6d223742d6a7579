"""``Fabric(strategy="logra_fsdp")``: the Trainer strategy's LoGRA parts for Fabric loops.

Build the model under ``fabric.init_module(empty_init=True)`` (on the meta device: each rank
gets storage for its own shard only; a Hugging Face model reads it from its safetensors
files) and set it up first (``model = fabric.setup_module(model)``), then create and set up
the optimizer over its parameters, as FSDP2 requires. Each step hands its inputs down:
``report = fabric.strategy.logra_step(optimizer, LoGRAStepInputs(probe=...))`` applies the
LoGRA update to the targets, scaled to the KL budget on that probe batch, then steps the
optimizer (non-targets, if trainable), and returns the ``StepReport`` (``.metrics()`` for
``fabric.log_dict``). ``fabric.save`` / ``fabric.load`` include LoGRA's state.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import ModelParallelStrategy
from torch import nn
from typing_extensions import override

from lightning_logra.core.config import LoGRAConfig
from lightning_logra.core.report import StepReport
from lightning_logra.core.step_inputs import LoGRAStepInputs
from lightning_logra.strategies.checkpoints.folder import split_state
from lightning_logra.strategies.checkpoints.strategy import CheckpointFoldersMixin
from lightning_logra.strategies.checkpoints.writer_lock import DEFAULT_LEASE_S
from lightning_logra.strategies.runtime import LoGRARuntimeMixin, compute_dtype_for
from lightning_logra.strategies.sharding import DataParallelShardingMixin


class LoGRAFabricStrategy(LoGRARuntimeMixin, DataParallelShardingMixin, CheckpointFoldersMixin,
                          ModelParallelStrategy):
    """FSDP2 data parallelism with LoGRA on the targets, for Fabric loops.

    On one device the module is not wrapped in FSDP2 (it would shard nothing and copy every
    block's weights at each call); it is moved to the device as it is. ``fabric.save``
    writes a checkpoint folder that loads on any number of devices.

    Args:
        logra: LoGRA's settings (``LoGRAConfig``; the paper's defaults).
        train_non_targets: leave the parameters that are not LoGRA targets to your optimizer
            instead of freezing them.
        layer_classes: names of the block classes FSDP2 shards one by one (default: the
            model's ``_no_split_modules``, else every ``nn.ModuleList`` entry).
        process_group_backend: torch.distributed backend (default: nccl on GPU, gloo on CPU).
        timeout: how long a collective may wait for the other ranks.
        measure_kl: also measure the true KL of each applied update on the probe responses
            (``StepReport.measured_kl``; one forward before and one after the update).
        checkpoint_lock_lease_s: the lease of the checkpoint folder's writer lock, held
            during each ``fabric.save``: a lock its run has not renewed for this long (it
            renews every third of it) may be taken over.
    """

    def __init__(
        self,
        logra: LoGRAConfig | None = None,
        train_non_targets: bool = False,
        layer_classes: list[str] | None = None,
        measure_kl: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        checkpoint_lock_lease_s: float = DEFAULT_LEASE_S,
    ) -> None:
        super().__init__(
            parallelize_fn=self._shard,
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._init_runtime(logra, train_non_targets, measure_kl=measure_kl)
        self._init_sharding(layer_classes)
        self._init_checkpoints(checkpoint_lock_lease_s)

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        compute_dtype = compute_dtype_for(self.precision.precision)
        self.runtime.check_hooks(module)
        module = super().setup_module(module)
        if not self._shards_policy():
            module.to(self.root_device)  # Lightning leaves placement to fully_shard, which did not run
        self.runtime.install(module, compute_dtype=compute_dtype)
        return module

    def _compute_dtype(self) -> torch.dtype | None:
        return compute_dtype_for(self.precision.precision)

    @override
    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        self.runtime.remember_base_lr([optimizer])
        return super().setup_optimizer(optimizer)

    @override
    def optimizer_step(self, optimizer, **kwargs: Any) -> Any:
        """``optimizer.step()`` in a Fabric loop: the LoGRA update with no inputs (so no
        probe: only with ``kl_control`` off), then the user's optimizer. Use ``logra_step``
        to hand the step its inputs."""
        self.runtime.step(optimizer, LoGRAStepInputs(), process_group=self._data_parallel_group())
        return super().optimizer_step(optimizer, **kwargs)

    def logra_step(self, optimizer: torch.optim.Optimizer, logra_inputs: LoGRAStepInputs) -> StepReport:
        """One optimizer step with this step's inputs (the probe responses, log-prob pairs,
        token count): the LoGRA update of the targets, then ``optimizer`` (Fabric's
        wrapper or the optimizer itself) on the non-targets, if any are trainable. Returns
        the update's ``StepReport`` (``.metrics()`` for ``fabric.log_dict``). Fabric's
        ``optimizer.step()`` takes no arguments, hence this method."""
        if not isinstance(logra_inputs, LoGRAStepInputs):
            raise TypeError(f"logra_step(optimizer, logra_inputs) takes a LoGRAStepInputs, got "
                            f"{type(logra_inputs).__name__}")
        user_optimizer = getattr(optimizer, "optimizer", optimizer)  # Fabric's wrapper would step again
        report = self.runtime.step(user_optimizer, logra_inputs, process_group=self._data_parallel_group())
        super().optimizer_step(user_optimizer)
        return report

    @override
    def save_checkpoint(self, path, state: dict[str, Any], storage_options: Any = None, filter: Any = None) -> None:
        name = type(self).__name__
        if storage_options is not None:
            raise TypeError(f"{name}.save_checkpoint does not take storage_options: drop the argument")
        if filter is not None:
            raise NotImplementedError(
                f"{name} saves whole state dicts (a distributed checkpoint cannot load filtered ones): drop filter="
            )
        tensors, metadata = split_state(state, name)
        try:
            self._save_folder(path, tensors, metadata)
        finally:
            # Fabric has no teardown to release it at the end of a run: the lock covers each save.
            self._on_rank_zero(self._release_writer_locks)

    @override
    def load_checkpoint(self, path, state: Any = None, strict: bool = True, weights_only: bool | None = None) -> dict[str, Any]:
        if not isinstance(state, dict) or not state:
            # fabric.load_raw(path, module) reads a weights file, not a folder; no state at all is
            # an error that names the fix. Lightning's own code does both.
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        return self._load_folder(path, state, strict=strict, weights_only=weights_only)
