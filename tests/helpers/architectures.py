"""Tiny random models of architectures other than Qwen2, built offline from transformers
configs: ones whose attention follows packed position ids (Llama) and ones whose packed
log-probs differ from the padded ones (OPT, BLOOM: their causal masks ignore position ids,
so packed sequences attend to each other), and a Hugging Face folder of one with the byte
tokenizer."""

import torch
from transformers import BloomConfig, BloomForCausalLM, LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

from tests.helpers.models import byte_tokenizer

VOCAB = 259  # byte_tokenizer's 256 symbols and 3 specials


def tiny_llama(vocab_size: int = VOCAB, attention: str = "sdpa") -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation=attention)
    return LlamaForCausalLM(config).eval()


def tiny_opt(vocab_size: int = VOCAB, attention: str = "sdpa") -> OPTForCausalLM:
    torch.manual_seed(0)
    config = OPTConfig(vocab_size=vocab_size, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                       word_embed_proj_dim=32, max_position_embeddings=128, attn_implementation=attention)
    return OPTForCausalLM(config).eval()


def tiny_bloom(vocab_size: int = VOCAB) -> BloomForCausalLM:
    torch.manual_seed(0)
    # transformers has no sdpa attention for BLOOM: eager is its only implementation.
    config = BloomConfig(vocab_size=vocab_size, hidden_size=32, n_layer=2, n_head=4, attn_implementation="eager")
    return BloomForCausalLM(config).eval()


def save_with_byte_tokenizer(model, folder) -> str:
    """``model`` and the byte tokenizer saved as one Hugging Face folder (EOS: ``<|im_end|>``)."""
    tokenizer = byte_tokenizer(folder)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)
