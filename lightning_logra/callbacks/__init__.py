from lightning_logra.callbacks.logra import LoGRACallback
from lightning_logra.callbacks.summary import RunSummary

__all__ = ["LoGRACallback", "RunSummary"]
