"""``Trainer(strategy="logra_fsdp")``: FSDP2 data parallelism with LoGRA updates."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_summary import ModelSummary as Summary
from typing_extensions import override

from lightning_logra.config import LoGRAConfig
from lightning_logra.strategies.runtime import LoGRAStrategyMixin, compute_dtype_for


class LoGRAFSDPStrategy(LoGRAStrategyMixin, ModelParallelStrategy):
    """FSDP2 (row-sharded float32 weights), data-parallel only, with LoGRA on the targets.

    On one device the policy is not wrapped in FSDP2: it would shard nothing and copy every
    block's weights at each module call. Checkpoints are the same folders either way, so a
    run resumes on another number of devices.

    Optimizer contract: keep your ``configure_optimizers``. The target weights (``logra.
    target_modules``) are updated by LoGRA once per optimizer step, after all micro-batches,
    scaled to the KL budget; every other parameter is frozen (the paper's setting) unless
    ``train_non_targets=True``, in which case your optimizer steps them. LoGRA's step size is
    ``logra.update_ratio``, constant unless ``logra.follow_lr_schedule`` is set.

    The LightningModule may define ``logra_model()`` (the module to train, e.g. the policy
    when a reference model sits beside it), ``logra_normalization_tokens()`` (the global
    count of loss-bearing tokens when the loss is a sum over tokens), ``logra_probe_batch()``
    (the responses the KL probe scores; default: the training batch) and
    ``logra_logprob_pairs()`` (rollout vs trainer log-probs, for the mismatch term).
    """

    def __init__(
        self,
        logra: LoGRAConfig | None = None,
        train_non_targets: bool = False,
        layer_classes: list[str] | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._init_logra(logra, train_non_targets, layer_classes)
        self._batch: Any = None

    @override
    def setup(self, trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        compute_dtype = compute_dtype_for(trainer.precision)
        self.accelerator.setup(trainer)
        module = self.lightning_module
        self._shard(module, self.device_mesh)
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        self.runtime.install(module, compute_dtype=compute_dtype)
        self.runtime.remember_base_lr(self.optimizers)
        self.runtime.measure_kl = any(getattr(callback, "measure_kl", False) for callback in trainer.callbacks)
        _count_targets_as_trainable(trainer, self.runtime.trained_parameters())

    def _compute_dtype(self) -> torch.dtype | None:
        return compute_dtype_for(self.lightning_module.trainer.precision)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._batch = args[0] if args else kwargs.get("batch")  # the KL probe's default data
        return super().training_step(*args, **kwargs)

    @override
    def optimizer_step(self, optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        """Run the closure (training_step + backward), then the LoGRA update, then the
        user's optimizer (non-target parameters, if any are trainable)."""
        module = self.lightning_module

        def closure_then_logra_update() -> Any:
            result = closure()
            # Automatic optimization skips a step whose training_step returned None.
            self.runtime.step(module, optimizer, batch=self._batch, process_group=self._data_parallel_group(),
                              allow_no_backward=module.automatic_optimization)
            return result

        return super().optimizer_step(optimizer, closure_then_logra_update, model, **kwargs)

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
        # Lightning's own metadata (loops, callbacks, hyper-parameters) is pickled Python objects.
        return self._load_folder(checkpoint_path, state, strict=self.lightning_module.strict_loading, weights_only=False)


class _LoGRASummary(Summary):
    """Lightning's model summary, counting LoGRA's targets as trainable: they are frozen
    for autograd only because their gradients arrive as sketches."""

    def __init__(self, model, max_depth: int, logra_parameters: int) -> None:
        self.logra_parameters = logra_parameters
        super().__init__(model, max_depth=max_depth)

    @property
    @override
    def trainable_parameters(self) -> int:
        return super().trainable_parameters + self.logra_parameters


def _count_targets_as_trainable(trainer, logra_parameters: int) -> None:
    for callback in trainer.callbacks:
        if isinstance(callback, ModelSummary):
            callback._summary = lambda trainer, pl_module, depth=callback._max_depth: _LoGRASummary(
                pl_module, depth, logra_parameters
            )
