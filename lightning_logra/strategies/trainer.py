"""``Trainer(strategy="logra_fsdp")``: FSDP2 data parallelism with LoGRA updates."""

from __future__ import annotations

import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.model_parallel import _load_checkpoint
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn

from lightning_logra.config import LoGRAConfig
from lightning_logra.strategies.engine import LoGRAStrategyMixin, compute_dtype_for, normalization_tokens_of


PARTIAL_SUFFIX = ".partial"


class LoGRAFSDPStrategy(LoGRAStrategyMixin, ModelParallelStrategy):
    """FSDP2 (row-sharded float32 weights), data-parallel only, with LoGRA on the targets.

    Optimizer contract: keep your ``configure_optimizers``. The target weights (``logra.
    target_modules``) are updated by LoGRA once per optimizer step, after all micro-batches;
    every other parameter is frozen (the paper's setting) unless ``train_non_targets=True``,
    in which case your optimizer steps them. Your optimizer's learning rate scales LoGRA's
    step (update_ratio x lr / initial lr), so your scheduler's warm-up and decay apply.

    The LightningModule may define ``logra_model()`` (the module to train, e.g. the policy
    when a reference model sits beside it), ``logra_normalization_tokens()`` (the global
    count of loss-bearing tokens when the loss is a sum over tokens), ``logra_probe_batch()``
    and ``logra_logprob_pairs()`` (read by ``LoGRACallback``).
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
        self.runtime.controller = _find_controller(trainer)

    def optimizer_step(self, optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        """Run the closure (training_step + backward), then the LoGRA update, then the
        user's optimizer (non-target parameters, if any are trainable)."""
        module = self.lightning_module
        automatic = module.automatic_optimization
        group = self.device_mesh["data_parallel"].get_group()

        def closure_then_logra_update() -> Any:
            result = closure()
            self.runtime.update(
                optimizer,
                normalization_tokens=normalization_tokens_of(module),
                process_group=group,
                # Automatic optimization skips a step whose training_step returned None.
                backward_ran=(lambda: self.runtime.any_backward(group)) if automatic else None,
            )
            return result

        return super().optimizer_step(optimizer, closure_then_logra_update, model, **kwargs)

    # Checkpoints: always distributed (one shard per rank), with LoGRA's tensors beside the
    # model and optimizer shards and its configuration in the rank-0 metadata file. Written
    # into "<name>.partial" and renamed into place once every rank has finished, so a run
    # killed mid-save never leaves a checkpoint that looks complete.
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options")
        path = Path(self.broadcast(filepath))
        partial = path.with_name(path.name + PARTIAL_SUFFIX)
        if self.global_rank == 0 and partial.exists():
            shutil.rmtree(partial)
        self.barrier()
        shards = {"state_dict": checkpoint.pop("state_dict"), "logra": self.runtime.checkpoint_tensors()}
        shards.update({f"optimizer_{i}": state for i, state in enumerate(checkpoint.pop("optimizer_states", []))})
        dcp.save(shards, checkpoint_id=partial)
        if self.global_rank == 0:
            torch.save({**checkpoint, "logra": self.runtime.checkpoint_metadata()}, partial / _METADATA_FILENAME)
        self.barrier()
        if self.global_rank == 0:
            _move_into_place(partial, path)
        self.barrier()

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        metadata_file = path / _METADATA_FILENAME
        if not metadata_file.is_file():
            raise ValueError(f"{path} is not a LoGRA checkpoint folder (no {_METADATA_FILENAME})")
        metadata = torch.load(metadata_file, weights_only=False).get("logra")
        self.runtime.check_metadata(metadata)  # a config mismatch fails before any state is loaded
        state = {"state_dict": self.model, **{f"optimizer_{i}": o for i, o in enumerate(self.optimizers)}}
        remaining = _load_checkpoint(path=path, state=state, strict=self.lightning_module.strict_loading,
                                     optimizer_states_from_list=True, weights_only=False)
        tensors = {"logra": self.runtime.checkpoint_tensors()}
        dcp.load(tensors, checkpoint_id=path)
        self.runtime.load_checkpoint_tensors(tensors["logra"], metadata)
        return remaining


def _move_into_place(partial: Path, path: Path) -> None:
    """Replace ``path`` by the finished ``partial`` folder (two renames, no copying)."""
    if path.is_file() or path.is_symlink():
        path.unlink()
    elif path.exists():
        retired = path.with_name(path.name + ".old")
        if retired.exists():
            shutil.rmtree(retired)
        path.rename(retired)
        partial.rename(path)
        shutil.rmtree(retired)
        return
    partial.rename(path)


def _find_controller(trainer):
    from lightning_logra.callbacks.logra import LoGRACallback

    found = [callback for callback in trainer.callbacks if isinstance(callback, LoGRACallback)]
    return found[0] if found else None
