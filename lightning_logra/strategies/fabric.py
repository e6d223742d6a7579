"""``Fabric(strategy="logra_fsdp")``: the Trainer strategy's LoGRA parts for Fabric loops.

Set up the model first (``model = fabric.setup_module(model)``), then create and set up
the optimizer over its parameters, as FSDP2 requires. ``optimizer.step()`` applies the
LoGRA update to the targets, scaled to the KL budget on the module's
``logra_probe_batch()``, then steps the optimizer (non-targets, if trainable).
``strategy.last_report`` tells what the step did (``.metrics()`` for ``fabric.log_dict``).
``fabric.save`` / ``fabric.load`` include LoGRA's state.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import ModelParallelStrategy
from torch import nn
from typing_extensions import override

from lightning_logra.config import LoGRAConfig
from lightning_logra.strategies.runtime import LoGRAStrategyMixin, compute_dtype_for


class LoGRAFabricStrategy(LoGRAStrategyMixin, ModelParallelStrategy):
    def __init__(
        self,
        logra: LoGRAConfig | None = None,
        train_non_targets: bool = False,
        layer_classes: list[str] | None = None,
        measure_kl: bool = False,
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
        self._init_logra(logra, train_non_targets, layer_classes, measure_kl=measure_kl)
        self._module: nn.Module | None = None

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        compute_dtype = compute_dtype_for(self.precision.precision)
        module = super().setup_module(module)
        self.runtime.install(module, compute_dtype=compute_dtype)
        self._module = module
        return module

    @override
    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        self.runtime.remember_base_lr([optimizer])
        return super().setup_optimizer(optimizer)

    @override
    def optimizer_step(self, optimizer, **kwargs: Any) -> Any:
        self.runtime.step(self._module, optimizer, batch=None, process_group=self._data_parallel_group())
        return super().optimizer_step(optimizer, **kwargs)

    @override
    def save_checkpoint(self, path, state: dict[str, Any], storage_options: Any = None, filter: Any = None) -> None:
        def write(folder: Path) -> None:
            super(LoGRAFabricStrategy, self).save_checkpoint(folder, state, storage_options=storage_options, filter=filter)
            self.runtime.save_state(folder)

        self._write_atomically(path, write)

    @override
    def load_checkpoint(self, path, state: Any = None, strict: bool = True, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(path))
        logra_state = self.runtime.read_state(path)  # a config mismatch fails before any state is loaded
        remaining = super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        self.runtime.load_state(logra_state)
        return remaining
