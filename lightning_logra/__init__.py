"""lightning-logra: LoGRA full-parameter RL post-training for PyTorch Lightning.

The algorithm lives in plain-torch modules (config, projection, sketch, layout, row_adam,
kl, probe, optimizer, memory); importing the package also registers the ``logra_fsdp``
strategy name with Lightning's Trainer and Fabric.
"""

import warnings

# Lightning 2.6's batch flattening (lightning/pytorch/utilities/_pytree.py) builds torch's
# ``LeafSpec``, which recent torch deprecates with a FutureWarning on every fit: not the user's
# to act on. Only that message from only that module is ignored.
warnings.filterwarnings(
    "ignore",
    message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    category=FutureWarning,
    module=r"lightning\.pytorch\.utilities\._pytree",
)

from lightning_logra.config import LoGRAConfig
from lightning_logra.kl import KLController, kl_step_scale, predicted_kl, scheduled_budget
from lightning_logra.memory import MemoryReport, memory_report
from lightning_logra.optimizer import LoGRAOptimizer
from lightning_logra.report import StepReport
from lightning_logra.probe import ProbeBatch, probe_predicted_kl
from lightning_logra.projection import make_projection, projection_seed
from lightning_logra.row_adam import row_adam_direction
from lightning_logra.sketch import install_sketches, remove_sketches
from lightning_logra.strategies import LoGRAFabricStrategy, LoGRAFSDPStrategy  # registers "logra_fsdp"
from lightning_logra.callbacks import LoGRACallback  # isort: skip

__all__ = [
    "KLController",
    "LoGRACallback",
    "LoGRAConfig",
    "LoGRAFSDPStrategy",
    "LoGRAFabricStrategy",
    "LoGRAOptimizer",
    "MemoryReport",
    "ProbeBatch",
    "StepReport",
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
