"""Loading policy models and tokenizers (shared by ``modules`` and ``data``), and exporting
a trained policy from a checkpoint as a Hugging Face folder."""

from lightning_logra.models.export import ExportedModel, export_checkpoint
from lightning_logra.models.loading import (
    BUILTIN_MODELS,
    CACHE_ENV,
    BuiltinModel,
    builtin_model_dir,
    cache_root,
    enable_activation_checkpointing,
    ensure_converted,
    load_policy,
    load_tokenizer,
    model_source,
    with_lora,
)

__all__ = [
    "BUILTIN_MODELS",
    "CACHE_ENV",
    "BuiltinModel",
    "ExportedModel",
    "builtin_model_dir",
    "cache_root",
    "enable_activation_checkpointing",
    "ensure_converted",
    "export_checkpoint",
    "load_policy",
    "load_tokenizer",
    "model_source",
    "with_lora",
]
