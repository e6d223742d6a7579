"""lightning-logra: LoGRA full-parameter RL post-training for PyTorch Lightning.

The algorithm is plain torch in ``lightning_logra.core``; the RL step's plain-torch pieces
are in ``lightning_logra.rl``; ``lightning_logra.hooks`` is the typed contract between a
LightningModule and the strategy; ``lightning_logra.planning`` predicts a whole step's
memory. Importing the package registers the ``logra_fsdp``
strategy name with Lightning's Trainer and Fabric.
"""

from lightning_logra.core import (
    KLController,
    LoGRAConfig,
    LoGRAOptimizer,
    MemoryReport,
    ProbeBatch,
    StepReport,
    install_sketches,
    kl_step_scale,
    make_projection,
    memory_report,
    predicted_kl,
    probe_predicted_kl,
    projection_seed,
    remove_sketches,
    row_adam_direction,
    scheduled_budget,
)
from lightning_logra.hooks import LoGRAModuleHooks, LoGRAStepInputs
from lightning_logra.planning import StepMemory, StepSettings, step_memory
from lightning_logra.strategies import LoGRAFabricStrategy, LoGRAFSDPStrategy  # registers "logra_fsdp"
from lightning_logra.callbacks import LoGRACallback  # isort: skip

__all__ = [
    "KLController",
    "LoGRACallback",
    "LoGRAConfig",
    "LoGRAFSDPStrategy",
    "LoGRAFabricStrategy",
    "LoGRAModuleHooks",
    "LoGRAOptimizer",
    "LoGRAStepInputs",
    "MemoryReport",
    "ProbeBatch",
    "StepMemory",
    "StepReport",
    "StepSettings",
    "install_sketches",
    "kl_step_scale",
    "make_projection",
    "memory_report",
    "predicted_kl",
    "probe_predicted_kl",
    "projection_seed",
    "remove_sketches",
    "row_adam_direction",
    "scheduled_budget",
    "step_memory",
]
