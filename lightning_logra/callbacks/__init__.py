from lightning_logra.callbacks.logra import LoGRACallback
from lightning_logra.callbacks.progress import StepProgressBar
from lightning_logra.callbacks.summary import RunSummary

__all__ = ["LoGRACallback", "RunSummary", "StepProgressBar"]
