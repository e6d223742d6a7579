"""FSDP2 data parallelism for the strategies: which module LoGRA trains, sharding it (and
the frozen models the module names) block by block across two or more ranks, none on one
device, and filling what was built on the meta device with each rank's own rows."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn
from transformers import PreTrainedModel

from lightning_logra.core.sketch import is_target_name
from lightning_logra.hooks import ProvidesFrozenModels, ProvidesLoGRAModel
from lightning_logra.models.sharded_loading import is_empty, materialize
from lightning_logra.allocator import tune_glibc_malloc
from lightning_logra.notices import quiet_lightning_pytree_notice


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


class DataParallelShardingMixin:
    """What both strategy classes add to their Lightning base for FSDP2: data-parallel-only
    sizing, and the policy sharded across two or more ranks (none on one device)."""

    def _init_sharding(self, layer_classes: list[str] | None) -> None:
        self.layer_classes = layer_classes

    def setup_environment(self) -> None:
        quiet_lightning_pytree_notice()
        tune_glibc_malloc()  # in every rank (Python users too), before the model is set up
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
