"""Offline builders for tiny random Hugging Face models, a byte-level ChatML tokenizer (no
downloads), and fixed inputs for them."""

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_qwen2(vocab_size: int = 64, seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return Qwen2ForCausalLM(config).eval()


def byte_tokenizer(tmp_path) -> PreTrainedTokenizerFast:
    """The 256 ByteLevel symbols (ids 0-255) and three ChatML specials (256-258), no merges.

    Saved to ``tmp_path/tokenizer`` and reloaded, as a user's tokenizer folder would be.
    """
    vocab = {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
    )
    folder = tmp_path / "tokenizer"
    tokenizer.save_pretrained(folder)
    return PreTrainedTokenizerFast.from_pretrained(folder)


@torch.no_grad()
def favour_token(model: Qwen2ForCausalLM, token_id: int, strength: float) -> None:
    """Point ``token_id``'s head row along the mean final hidden state, so that a random
    model emits that token (e.g. EOS) often enough for tests of stopping."""
    probe = torch.randint(0, model.config.vocab_size, (8, 16), generator=torch.Generator().manual_seed(0))
    mean_hidden = model.model(probe).last_hidden_state.reshape(-1, model.config.hidden_size).mean(0)
    model.lm_head.weight[token_id] = strength * mean_hidden / mean_hidden.norm() ** 2


PROBE_VOCAB = 97


def probe_qwen2(attention: str = "eager") -> Qwen2ForCausalLM:
    """The KL-probe tests' Qwen2: ``tiny_qwen2``'s shape with 97 tokens, 64 positions and the
    given attention implementation, left in training mode."""
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=PROBE_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    config._attn_implementation = attention
    return Qwen2ForCausalLM(config)


def left_padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of 6 tokens for ``tiny_qwen2``; the first is left-padded by 2."""
    input_ids = torch.tensor([[0, 0, 5, 9, 3, 7], [4, 8, 1, 2, 6, 3]])
    attention_mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    return input_ids, attention_mask


def save_tied_qwen2(folder) -> str:
    """A tiny random Qwen2 whose head is its embedding (as SmolLM2's), with a byte tokenizer,
    saved as a Hugging Face folder in ``folder``."""
    tokenizer = byte_tokenizer(folder)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)
