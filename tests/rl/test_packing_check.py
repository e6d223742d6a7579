"""The check that a model computes packed log-probs as it computes padded ones: models whose
attention follows packed position ids pass; OPT and BLOOM, whose packed log-probs differ,
are refused by class name. The check leaves the random state, the training mode and the
float32 matmul precision as they were."""

import pytest
import torch

from lightning_logra.rl.packing import check_packing, packed_padded_difference
from tests.helpers.architectures import tiny_bloom, tiny_llama, tiny_opt
from tests.helpers.models import tiny_qwen2


def qwen2_with(attention: str):
    model = tiny_qwen2()
    model.config._attn_implementation = attention
    return model


@pytest.mark.parametrize("build", [lambda: qwen2_with("sdpa"), lambda: qwen2_with("eager"), tiny_llama],
                         ids=["qwen2_sdpa", "qwen2_eager", "llama"])
def test_a_model_that_packs_as_it_pads_passes(build):
    assert check_packing(build()) < 1e-5


@pytest.mark.parametrize(("build", "name"), [(tiny_opt, "OPTForCausalLM"), (tiny_bloom, "BloomForCausalLM")])
def test_a_model_whose_packed_logprobs_differ_is_refused_by_class(build, name):
    model = build()
    difference = packed_padded_difference(model)
    assert difference > 5e-4  # measured: OPT 6.2e-2, BLOOM 1.0e-3 on these tiny models
    with pytest.raises(ValueError, match=rf"{name}: packed log-probs differ from the padded ones by up to "
                                         rf"{difference:.2g} .*unset batching.micro_batch_tokens"):
        check_packing(model)


def test_a_bf16_model_is_held_to_a_wider_tolerance():
    # 8 significant bits: round-off alone moves packed and padded log-probs apart by ~1e-3.
    assert check_packing(tiny_qwen2().to(torch.bfloat16)) < 5e-2
    with pytest.raises(ValueError, match="OPTForCausalLM"):
        check_packing(tiny_opt().to(torch.bfloat16))


def test_the_check_leaves_the_random_state_and_training_mode_as_they_were():
    model = tiny_qwen2().train()
    for layer in model.model.layers:  # in training mode dropout would make packed and padded differ
        layer.self_attn.attention_dropout = 0.5
    model.model.layers[0].eval()  # a submodule the user keeps in eval mode stays there
    modes = {name: module.training for name, module in model.named_modules()}
    torch.manual_seed(123)
    state = torch.get_rng_state()
    assert check_packing(model) < 1e-5
    assert torch.equal(torch.get_rng_state(), state)
    assert {name: module.training for name, module in model.named_modules()} == modes


def test_every_rank_refuses_when_any_rank_measured_a_difference():
    asked = []
    with pytest.raises(ValueError, match="Qwen2ForCausalLM"):
        check_packing(tiny_qwen2(), any_rank=lambda flag: asked.append(flag) or True)
    assert asked == [False]  # this rank's own measurement passed; another rank's did not


def test_the_check_runs_float32_matmuls_at_full_precision_and_restores_the_setting():
    # TF32 (set by float32 matmul precision "high" or "medium") rounds like 16-bit weights.
    model = tiny_qwen2()
    seen = []
    model.register_forward_pre_hook(lambda *args: seen.append(torch.backends.cuda.matmul.fp32_precision))
    torch.set_float32_matmul_precision("medium")
    try:
        check_packing(model)
        assert seen == ["ieee", "ieee"]  # the padded and the packed forward
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision("highest")
