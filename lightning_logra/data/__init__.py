"""Prompt data for RL post-training and chat data for SFT: row sources, validation and LightningDataModules."""

from lightning_logra.data.code_tasks import code_rows
from lightning_logra.data.conversations import ConversationDataModule, calculator_conversations
from lightning_logra.data.datamodule import (
    PromptDataModule,
    PromptDataset,
    ResumableLoader,
    ResumableSampler,
    collate_prompts,
)
from lightning_logra.data.sources import arithmetic_rows, read_rows, reasoning_gym_rows, validate_rows

__all__ = [
    "ConversationDataModule",
    "PromptDataModule",
    "PromptDataset",
    "ResumableLoader",
    "ResumableSampler",
    "arithmetic_rows",
    "calculator_conversations",
    "code_rows",
    "collate_prompts",
    "read_rows",
    "reasoning_gym_rows",
    "validate_rows",
]
