"""step_memory: the whole step's bytes per rank, from shapes alone.

The parts that are bookkeeping (weights, gradients, moments, shards, LoRA adapters, LoGRA's
state) are checked exactly; the activation counts are checked against what autograd
really saves for a Qwen2 decoder layer (saved-tensor hooks), so a change in transformers'
layer shows up here. The whole prediction against measured peaks is benchmarks/fits.py's.
"""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from lightning_logra import LoGRAConfig, memory_report
from lightning_logra.core.layout import rows_per_rank
from lightning_logra.planning.step_memory import StepSettings, decoder_shape, layer_activation_bytes, step_memory
from lightning_logra.models import with_lora
from lightning_logra.rl.config import LoRAConfig

SHAPE = dict(hidden_size=256, intermediate_size=704, num_attention_heads=4, num_key_value_heads=1, vocab_size=1000,
             tie_word_embeddings=False)


def qwen2(layers: int = 2, meta: bool = True, **overrides) -> Qwen2ForCausalLM:
    with torch.device("meta") if meta else torch.device("cpu"):
        return Qwen2ForCausalLM(Qwen2Config(**{**SHAPE, "num_hidden_layers": layers, **overrides}))


def parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_dense_on_one_process_holds_weights_gradients_and_two_moments_in_float32():
    model = qwen2()
    memory = step_memory(model, StepSettings(method="dense", tokens=64))
    count = parameters(model)
    assert (memory.weights, memory.gradients, memory.optimizer_state) == (4 * count, 4 * count, 8 * count)
    assert memory.logra_state == memory.gathered_weights == memory.autocast_cache == memory.reference == 0
    assert memory.held == memory.weights + memory.optimizer_state
    assert memory.peak == max(memory.backward_peak, memory.update_peak)
    assert memory.backward_peak == memory.held + memory.gradients + memory.activations


def test_sharding_divides_what_is_sharded_and_adds_the_gathered_blocks():
    model = qwen2()
    count = parameters(model)
    block = sum(p.numel() for p in model.model.layers[0].parameters())
    memory = step_memory(model, StepSettings(method="dense", tokens=64, world_size=8))
    assert memory.weights == rows_per_rank(count, 8) * 4
    assert memory.optimizer_state == 2 * rows_per_rank(count, 8) * 4
    assert memory.gathered_weights == (2 * block + count - 2 * block) * 4  # two blocks here: the root is the rest


def test_logra_holds_no_gradient_and_its_state_is_memory_reports():
    model = qwen2()
    config = LoGRAConfig(rank=16)
    for world in (1, 4):
        memory = step_memory(model, StepSettings(method="logra", tokens=64, world_size=world, logra=config))
        assert memory.gradients == memory.optimizer_state == 0
        assert memory.logra_state == memory_report(model, config, world_size=world,
                                                   compute_dtype=torch.float32).logra_state_bytes


def test_lora_adapters_count_what_peft_trains():
    model = qwen2(meta=False)
    memory = step_memory(model, StepSettings(method="lora", tokens=64, lora_rank=8))
    trainable = sum(p.numel() for p in with_lora(model, LoRAConfig(rank=8, alpha=16.0)).parameters() if p.requires_grad)
    assert memory.gradients == 4 * trainable
    assert memory.optimizer_state == 8 * trainable
    assert memory.weights == 4 * (sum(p.numel() for p in qwen2().parameters()) + trainable)


def test_bf16_autocast_caches_the_trained_linear_weights_and_keeps_the_reference_in_bf16():
    model = qwen2()
    count = parameters(model)
    dense = step_memory(model, StepSettings(method="dense", tokens=64, compute_dtype=torch.bfloat16, reference=True))
    logra = step_memory(model, StepSettings(method="logra", tokens=64, compute_dtype=torch.bfloat16, reference=True))
    linear = sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters())
    assert dense.autocast_cache == 2 * linear and logra.autocast_cache == 0
    assert dense.reference == logra.reference == 2 * count


def test_vllm_share_is_held_and_fits_takes_the_margin():
    memory = step_memory(qwen2(), StepSettings(method="logra", tokens=64, vllm_bytes=10**6))
    assert memory.vllm == 10**6 and memory.held >= 10**6
    assert memory.fits(memory.peak) and not memory.fits(memory.peak, margin_bytes=1)


@pytest.mark.parametrize("field, value", [("method", "adam"), ("tokens", 0), ("world_size", 0), ("vllm_bytes", -1),
                                          ("compute_dtype", torch.float16)])
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"StepSettings.{field}"):
        StepSettings(**{"method": "dense", "tokens": 8, field: value})


def saved_bytes(model, tokens: int, *, masked: bool, autocast: bool) -> int:
    """Bytes autograd saves in the decoder's forward (parameters excluded, storages once),
    from input embeddings that require grad (so a frozen model still builds a graph)."""
    parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameter_storages:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    embeddings = torch.randn(1, tokens, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(0),
                             requires_grad=True)
    mask = torch.ones(1, tokens, dtype=torch.long)
    if masked:
        mask[0, :4] = 0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model.model(inputs_embeds=embeddings, attention_mask=mask)
    return sum(seen.values())


@pytest.mark.parametrize("trained", [True, False])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_layer_activation_counts_match_what_autograd_saves(trained, masked, autocast, kv_heads):
    torch.manual_seed(0)
    one, three = (qwen2(layers, meta=False, num_key_value_heads=kv_heads).train().requires_grad_(trained)
                  for layers in (1, 3))
    tokens = 128
    per_layer = (saved_bytes(three, tokens, masked=masked, autocast=autocast)
                 - saved_bytes(one, tokens, masked=masked, autocast=autocast)) / 2
    if autocast:  # the bf16 casts of the layer's weights, saved by its matmuls (not activations)
        per_layer -= 2 * sum(p.numel() for p in three.model.layers[0].parameters() if p.dim() == 2)
    dtype = torch.bfloat16 if autocast else torch.float32
    shape = decoder_shape(qwen2(num_key_value_heads=kv_heads), ["q_proj"], True)
    predicted = layer_activation_bytes(shape, tokens, tokens, masked=masked, dtype=dtype, trained_weights=trained)
    # The fitted per-token counts leave out a few elements per token (rotary tables, sdpa's
    # log-sum-exp per head, biases' shapes): under 1% of a layer.
    assert predicted == pytest.approx(per_layer, rel=0.01)
