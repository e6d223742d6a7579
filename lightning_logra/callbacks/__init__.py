from lightning_logra.callbacks.logra import LoGRACallback
from lightning_logra.callbacks.model_summary import LoGRAModelSummary
from lightning_logra.callbacks.preemption import PreemptionCheckpoint, Preempted
from lightning_logra.callbacks.progress import StepProgressBar
from lightning_logra.callbacks.summary import RunSummary

__all__ = ["LoGRACallback", "LoGRAModelSummary", "PreemptionCheckpoint", "Preempted", "RunSummary", "StepProgressBar"]
