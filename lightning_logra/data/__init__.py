"""Prompt data for RL post-training: row sources, validation and a LightningDataModule."""

from lightning_logra.data.datamodule import PromptDataModule, ResumableSampler
from lightning_logra.data.sources import arithmetic_rows, read_rows, reasoning_gym_rows, validate_rows

__all__ = [
    "PromptDataModule",
    "ResumableSampler",
    "arithmetic_rows",
    "read_rows",
    "reasoning_gym_rows",
    "validate_rows",
]
