"""LoGRA's algorithm in plain torch: no Lightning, transformers, peft, vLLM or MLflow.

One concept per module, in the order a step uses them: ``config``, ``projection`` (seeds and
draws of A), ``projected_input`` (X A^T), ``sketch`` (the hooks that accumulate
S = dY^T (X A^T)), ``sharded_accumulation`` and ``layout`` (how rows are split across ranks),
``row_adam``, ``kl`` (Fisher form, budget schedule, mismatch EMA, controller), ``probe`` and
``probe_modules`` (the forward-mode KL prediction), ``update`` and ``lowrank`` (W -= alpha D A),
``optimizer`` (the whole update in one call), ``report`` (what a step did), ``memory`` (what
LoGRA holds per rank), ``reliability`` (guards against silent failure) and ``reshard``
(FSDP2's gathered weights freed after a forward that no backward follows). What a whole RL
step holds per rank, for every method, is ``lightning_logra.planning``'s.
"""

from lightning_logra.core.config import LoGRAConfig
from lightning_logra.core.kl import KLController, kl_step_scale, predicted_kl, scheduled_budget
from lightning_logra.core.memory import MemoryReport, memory_report
from lightning_logra.core.optimizer import LoGRAOptimizer
from lightning_logra.core.probe import ProbeBatch, probe_predicted_kl
from lightning_logra.core.projection import make_projection, projection_seed
from lightning_logra.core.report import StepReport
from lightning_logra.core.row_adam import row_adam_direction
from lightning_logra.core.sketch import install_sketches, remove_sketches

__all__ = [
    "KLController",
    "LoGRAConfig",
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
