"""``Fabric(strategy="logra_fsdp")``: the Trainer strategy's LoGRA parts for Fabric loops.

Set up the model first (``model = fabric.setup_module(model)``), then create and set up
the optimizer over its parameters, as FSDP2 requires. ``optimizer.step()`` applies the
LoGRA update to the targets, then steps the optimizer (non-targets, if trainable).
KL control: pass ``kl_controller=LoGRACallback()``; the module must then define
``logra_probe_batch()``, since Fabric has no training batch to borrow.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import ModelParallelStrategy
from torch import nn

from lightning_logra.config import LoGRAConfig
from lightning_logra.strategies.engine import LoGRAStrategyMixin, compute_dtype_for, normalization_tokens_of

LOGRA_FOLDER = "logra"
LOGRA_METADATA = "logra_meta.pt"


class LoGRAFabricStrategy(LoGRAStrategyMixin, ModelParallelStrategy):
    def __init__(
        self,
        logra: LoGRAConfig | None = None,
        train_non_targets: bool = False,
        layer_classes: list[str] | None = None,
        kl_controller: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(
            parallelize_fn=self._shard,
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._init_logra(logra, train_non_targets, layer_classes)
        self.runtime.controller = kl_controller
        self._module: nn.Module | None = None

    def setup_module(self, module: nn.Module) -> nn.Module:
        compute_dtype = compute_dtype_for(self.precision.precision)
        module = super().setup_module(module)
        self.runtime.install(module, compute_dtype=compute_dtype)
        self._module = module
        if self.runtime.controller is not None:
            self.runtime.controller._module = module
        return module

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        self.runtime.remember_base_lr([optimizer])
        return super().setup_optimizer(optimizer)

    def optimizer_step(self, optimizer, **kwargs: Any) -> Any:
        self.runtime.update(
            optimizer,
            normalization_tokens=normalization_tokens_of(self._module),
            process_group=self.device_mesh["data_parallel"].get_group(),
        )
        return super().optimizer_step(optimizer, **kwargs)

    def save_checkpoint(self, path, state: dict[str, Any], storage_options: Any = None, filter: Any = None) -> None:
        super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)
        path = Path(self.broadcast(path))
        dcp.save({"logra": self.runtime.checkpoint_tensors()}, checkpoint_id=path / LOGRA_FOLDER)
        if self.global_rank == 0:
            torch.save(self.runtime.checkpoint_metadata(), path / LOGRA_METADATA)

    def load_checkpoint(self, path, state: Any = None, strict: bool = True, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(path))
        metadata_file = path / LOGRA_METADATA
        metadata = torch.load(metadata_file, weights_only=False) if metadata_file.is_file() else None
        self.runtime.check_metadata(metadata)
        remaining = super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        tensors = {"logra": self.runtime.checkpoint_tensors()}
        dcp.load(tensors, checkpoint_id=path / LOGRA_FOLDER)
        self.runtime.load_checkpoint_tensors(tensors["logra"], metadata)
        return remaining
