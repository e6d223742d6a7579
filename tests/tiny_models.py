"""Offline builders for a tiny random Qwen2 and a byte-level ChatML tokenizer (no downloads)."""

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
