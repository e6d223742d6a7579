"""lightning-logra: LoGRA full-parameter RL post-training for PyTorch Lightning.

The algorithm lives in plain-torch modules (config, projection, sketch, row_adam, kl,
optimizer, memory); importing the package also registers the ``logra_fsdp`` strategy
name with Lightning's Trainer and Fabric when Lightning is installed.
"""

from lightning_logra.config import LoGRAConfig
from lightning_logra.kl import kl_step_scale, predicted_kl, probe_predicted_kl, scheduled_budget
from lightning_logra.memory import MemoryReport, memory_report
from lightning_logra.optimizer import LoGRAOptimizer
from lightning_logra.projection import make_projection, projection_seed
from lightning_logra.row_adam import row_adam_direction
from lightning_logra.sketch import install_sketches, remove_sketches
from lightning_logra.strategies import LoGRAFabricStrategy, LoGRAFSDPStrategy  # registers "logra_fsdp"
from lightning_logra.callbacks import LoGRACallback  # isort: skip

__all__ = [
    "LoGRACallback",
    "LoGRAConfig",
    "LoGRAFSDPStrategy",
    "LoGRAFabricStrategy",
    "LoGRAOptimizer",
    "MemoryReport",
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
]
