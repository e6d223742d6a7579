"""``Trainer(strategy="logra_fsdp")``: FSDP2 data parallelism with LoGRA updates."""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

import torch

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.pytorch.strategies import ModelParallelStrategy
from typing_extensions import override

from lightning_logra.core.config import LoGRAConfig
from lightning_logra.core.report import StepReport
from lightning_logra.core.step_inputs import LoGRAStepInputs
from lightning_logra.hooks import with_default_probe
from lightning_logra.strategies.checkpoints.recovery import recover_checkpoint_folders, written_checkpoint_folders
from lightning_logra.strategies.checkpoints.strategy import CheckpointFoldersMixin
from lightning_logra.strategies.checkpoints.writer_lock import DEFAULT_LEASE_S, hold
from lightning_logra.strategies.runtime import LoGRARuntimeMixin, compute_dtype_for
from lightning_logra.strategies.sharding import DataParallelShardingMixin


@runtime_checkable
class AsksForMeasuredKL(Protocol):
    """A callback that wants the true KL of every update measured (``LoGRACallback(measure_kl=True)``)."""

    measure_kl: bool


class LoGRAFSDPStrategy(LoGRARuntimeMixin, DataParallelShardingMixin, CheckpointFoldersMixin,
                        ModelParallelStrategy):
    """FSDP2 (row-sharded float32 weights), data-parallel only, with LoGRA on the targets.

    ``configure_model`` runs on the meta device: what it builds gets storage in ``setup``,
    after sharding, each rank for its own shard only (a Hugging Face model reads its rows
    from its safetensors files, ``models.sharded_loading``).

    On one device the policy is not wrapped in FSDP2: it would shard nothing and copy every
    block's weights at each module call. Checkpoints are the same folders either way, so a
    run resumes on another number of devices.

    Optimizer contract: keep your ``configure_optimizers``. The target weights
    (``logra.target_modules``) are updated by LoGRA once per optimizer step, after all micro-batches,
    scaled to the KL budget; every other parameter is frozen (the paper's setting) unless
    ``train_non_targets=True``, in which case your optimizer steps them. LoGRA's step size is
    ``logra.update_ratio``, constant unless ``logra.follow_lr_schedule`` is set.

    Each step's inputs go down with it: ``report = self.optimizers().step(logra_inputs=
    LoGRAStepInputs(...))`` (the probe batch, log-prob pairs and token count of a step)
    returns the update's ``StepReport``; a step without them probes the training batch (a
    dict with ``input_ids``) with a mean loss. The LightningModule may provide the hooks of
    ``lightning_logra.hooks``: ``logra_model()`` (the module to train) and
    ``logra_frozen_models()`` (e.g. a KL reference), checked at setup.

    Args:
        logra: LoGRA's settings (``LoGRAConfig``; the paper's defaults).
        train_non_targets: leave the parameters that are not LoGRA targets to your optimizer
            instead of freezing them.
        layer_classes: names of the block classes FSDP2 shards one by one (default: the
            model's ``_no_split_modules``, else every ``nn.ModuleList`` entry).
        process_group_backend: torch.distributed backend (default: nccl on GPU, gloo on CPU).
        timeout: how long a collective may wait for the other ranks.
        checkpoint_lock_lease_s: the lease of the checkpoint folders' writer lock: a lock its
            run has not renewed for this long (it renews every third of it) may be taken over.
    """

    def __init__(
        self,
        logra: LoGRAConfig | None = None,
        train_non_targets: bool = False,
        layer_classes: list[str] | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        checkpoint_lock_lease_s: float = DEFAULT_LEASE_S,
    ) -> None:
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._init_runtime(logra, train_non_targets)
        self._init_sharding(layer_classes)
        self._init_checkpoints(checkpoint_lock_lease_s)
        self._batch: Any = None

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        trainer = self.lightning_module.trainer
        self._on_rank_zero(self._claim_folders, trainer)

    def _claim_folders(self, trainer) -> None:
        """Rank 0, at start-up: the writer lock of every folder the run writes, held until
        teardown (another live run there is refused before any step), then what a crash
        left mid-save recovered in each folder it reads, under that folder's lock."""
        for folder in written_checkpoint_folders(trainer):
            self._hold_folder(folder)
        recover_checkpoint_folders(trainer)

    @override
    def setup(self, trainer) -> None:
        compute_dtype = compute_dtype_for(trainer.precision)
        module = self.lightning_module
        self.runtime.check_hooks(module)
        # ModelParallelStrategy.setup adds one thing to Strategy.setup: it requires the module
        # to have sharded itself in configure_model. Here the strategy shards the policy (and
        # materialises what configure_model built on the meta device: Hugging Face models
        # from their safetensors files, each rank its own rows), then Lightning's own
        # Strategy.setup places the model, builds the optimizers and the precision plugin.
        self._shard(module, self.device_mesh)
        _materialize_distributed_module(self.model, self.root_device)
        super(ModelParallelStrategy, self).setup(trainer)
        self.runtime.install(module, compute_dtype=compute_dtype)
        self.runtime.remember_base_lr(self.optimizers)
        self.runtime.measure_kl = any(isinstance(callback, AsksForMeasuredKL) and callback.measure_kl
                                      for callback in trainer.callbacks)

    @override
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """The meta device unless ``empty_init=False``: ``configure_model`` builds the models
        empty, and ``setup`` gives each rank storage for its own shard only (Hugging Face
        models read it from their safetensors files)."""
        with super().tensor_init_context(empty_init=empty_init is not False):
            yield

    def _compute_dtype(self) -> torch.dtype | None:
        return compute_dtype_for(self.lightning_module.trainer.precision)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._batch = args[0] if args else kwargs.get("batch")  # the KL probe's default data
        return super().training_step(*args, **kwargs)

    @override
    def optimizer_step(self, optimizer, closure: Callable[[], Any], model=None, logra_inputs: LoGRAStepInputs | None = None,
                       **kwargs: Any) -> StepReport | None:
        """Run the closure (training_step + backward), then the LoGRA update with
        ``logra_inputs`` (``self.optimizers().step(logra_inputs=...)`` passes them here;
        without them the training batch is probed, ``hooks.with_default_probe``), then the
        user's optimizer (non-target parameters, if any are trainable). Returns the update's
        ``StepReport`` (None when no rank ran backward)."""
        module = self.lightning_module
        report: StepReport | None = None

        def closure_then_logra_update() -> Any:
            nonlocal report
            result = closure()
            # Automatic optimization skips a step whose training_step returned None.
            report = self.runtime.step(optimizer, with_default_probe(logra_inputs, self._batch),
                                       process_group=self._data_parallel_group(),
                                       allow_no_backward=module.automatic_optimization)
            return result

        super().optimizer_step(optimizer, closure_then_logra_update, model, **kwargs)
        return report

    # Checkpoints: always a folder of shards (one per rank), LoGRA's state in its own folder.
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options: drop the argument")
        tensors = {"state_dict": checkpoint.pop("state_dict")}
        tensors.update({f"optimizer_{i}": state for i, state in enumerate(checkpoint.pop("optimizer_states", []))})
        self._save_folder(filepath, tensors, checkpoint)

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        state = {"state_dict": self.model, **{f"optimizer_{i}": o for i, o in enumerate(self.optimizers)}}
        # Lightning's metadata (loops, callbacks, hyper-parameters) is read as Lightning reads a
        # .ckpt file: torch.load with the caller's weights_only (None: torch's default).
        return self._load_folder(checkpoint_path, state, strict=self.lightning_module.strict_loading,
                                 weights_only=weights_only)


def claim_checkpoint_folders(trainer) -> None:
    """What the strategy does at start-up, for code that needs it earlier: Lightning
    resolves ``ckpt_path="last"`` (and SLURM's ``hpc_ckpt_*``) before the strategy's setup,
    so ``logra fit`` calls this first, as should a script that passes such a ``ckpt_path``
    to ``trainer.fit``. On global rank 0 (a no-op elsewhere): holds the writer lock of
    every folder the run writes (refused if another live run holds one; released when
    the strategy tears down, or when the process exits) and recovers each folder it reads."""
    if trainer.global_rank != 0:
        return
    strategy = trainer.strategy
    lease_s = strategy.checkpoint_lock_lease_s if isinstance(strategy, LoGRAFSDPStrategy) else DEFAULT_LEASE_S
    for folder in written_checkpoint_folders(trainer):
        hold(folder, lease_s)
    recover_checkpoint_folders(trainer)
