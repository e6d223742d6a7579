"""Loading policy models and tokenizers (shared by ``modules`` and ``data``), whole or built
empty and filled rank by rank from safetensors files (``sharded_loading``), and exporting a
trained policy from a checkpoint as a Hugging Face folder."""

from lightning_logra.models.export import ExportedModel, export_checkpoint
from lightning_logra.models.loading import (
    BUILTIN_MODELS,
    CACHE_ENV,
    BuiltinModel,
    build_model,
    builtin_model_dir,
    cache_root,
    enable_activation_checkpointing,
    ensure_converted,
    load_policy,
    load_tokenizer,
    model_source,
    set_pad_token,
    with_lora,
)
from lightning_logra.models.sharded_loading import empty_policy, fill_from_safetensors, is_empty

__all__ = [
    "BUILTIN_MODELS",
    "CACHE_ENV",
    "BuiltinModel",
    "ExportedModel",
    "build_model",
    "builtin_model_dir",
    "cache_root",
    "enable_activation_checkpointing",
    "empty_policy",
    "ensure_converted",
    "export_checkpoint",
    "fill_from_safetensors",
    "is_empty",
    "load_policy",
    "load_tokenizer",
    "model_source",
    "set_pad_token",
    "with_lora",
]
