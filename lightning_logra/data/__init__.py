"""Prompt data for RL post-training: row sources, validation and a LightningDataModule."""

from lightning_logra.data.code_tasks import code_rows
from lightning_logra.data.datamodule import (
    PromptDataModule,
    PromptDataset,
    ResumableLoader,
    ResumableSampler,
    collate_prompts,
)
from lightning_logra.data.sources import arithmetic_rows, read_rows, reasoning_gym_rows, validate_rows

__all__ = [
    "PromptDataModule",
    "PromptDataset",
    "ResumableLoader",
    "ResumableSampler",
    "arithmetic_rows",
    "code_rows",
    "collate_prompts",
    "read_rows",
    "reasoning_gym_rows",
    "validate_rows",
]
