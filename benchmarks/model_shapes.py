"""Model shapes the benchmarks use, fixed before measuring (Qwen2 architecture).

``BENCH_156M`` is the CPU benchmark model, ``SMOKE`` the tiny one every ``--smoke`` run
uses. The Qwen2.5 entries carry the published sizes; ``27B-class`` is Qwen2.5-32B's
architecture with 52 of its 64 layers (26.9B parameters).
"""

BENCH_156M = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                  num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False)

QWEN_SHAPES = {
    "Qwen2.5-1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "Qwen2.5-7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "Qwen2.5-14B": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                        num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    "27B-class": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=52, num_attention_heads=40,
                      num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
}

# Every script's --smoke model: checks the code paths in seconds, measures nothing.
SMOKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False)


def decoder_slice(name: str, layers: int) -> dict:
    """``layers`` decoder layers of ``QWEN_SHAPES[name]`` at their real widths, with the
    vocabulary scaled by ``layers / num_hidden_layers`` so the output head keeps the real
    model's share of the linear work (the whole 152k-row head over 2 of 28 layers would be
    more than half of it, against about 8% in the real 7B model)."""
    real = QWEN_SHAPES[name]
    if not 1 <= layers <= real["num_hidden_layers"]:
        raise ValueError(f"layers={layers}: {name} has 1 to {real['num_hidden_layers']} decoder layers")
    vocab = round(real["vocab_size"] * layers / real["num_hidden_layers"])
    return {**real, "num_hidden_layers": layers, "vocab_size": vocab}
