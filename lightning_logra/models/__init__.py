"""Loading policy models and tokenizers; shared by ``modules`` and ``data``."""

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
)

__all__ = [
    "BUILTIN_MODELS",
    "CACHE_ENV",
    "BuiltinModel",
    "builtin_model_dir",
    "cache_root",
    "enable_activation_checkpointing",
    "ensure_converted",
    "load_policy",
    "load_tokenizer",
    "model_source",
]
