from lightning_logra.callbacks.logra import LoGRACallback

__all__ = ["LoGRACallback"]
