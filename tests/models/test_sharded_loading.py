"""Building a policy empty and filling it from its safetensors files: the same tensors,
buffers and logits as ``from_pretrained``, bit for bit (on two processes:
tests/integration/test_sharded_loading_two_ranks.py)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning_logra.models import empty_policy, fill_from_safetensors, is_empty
from tests.helpers.grpo import LOGIT_TOKENS, grpo_module
from tests.helpers.models import byte_tokenizer, tiny_qwen2


@pytest.fixture(scope="module")
def sharded_files_folder(tmp_path_factory) -> str:
    """A tiny untied Qwen2 saved as several safetensors files and their index, as the hub's are."""
    folder = tmp_path_factory.mktemp("sharded-files")
    tokenizer = byte_tokenizer(folder)
    tiny_qwen2(vocab_size=len(tokenizer)).save_pretrained(folder, max_shard_size="20KB")
    assert (folder / "model.safetensors.index.json").is_file()
    return str(folder)


def assert_same_as_from_pretrained(model, folder, dtype):
    full = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    assert model.state_dict().keys() == full.state_dict().keys()
    for name, value in full.state_dict().items():
        assert value.dtype == model.state_dict()[name].dtype and torch.equal(model.state_dict()[name], value), name
    for (name, buffer), (_, expected) in zip(model.named_buffers(), full.named_buffers()):
        assert torch.equal(buffer, expected), name  # rotary frequencies computed, not left empty
    with torch.no_grad():
        assert torch.equal(model.eval()(input_ids=LOGIT_TOKENS).logits, full.eval()(input_ids=LOGIT_TOKENS).logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("files", ["tied_folder", "sharded_files_folder"])
def test_filled_model_equals_from_pretrained_bit_for_bit(request, files, dtype):
    folder = request.getfixturevalue(files)
    model = empty_policy(folder, dtype=dtype)
    assert is_empty(model) and model.name_or_path == folder
    fill_from_safetensors(model)
    assert not is_empty(model)
    tied = model.config.tie_word_embeddings
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == tied
    assert_same_as_from_pretrained(model, folder, dtype)


def test_a_folder_without_safetensors_is_refused_before_anything_is_built(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds neither model.safetensors nor model.safetensors.index.json"):
        empty_policy(str(tmp_path))


def test_a_weight_the_files_lack_or_store_in_another_shape_is_named(tied_folder, model_folder):
    model = empty_policy(tied_folder)
    model.name_or_path = model_folder  # untied: its files hold lm_head, the tied model expects no more
    model.model.norm.weight = torch.nn.Parameter(torch.empty(3, device="meta"))
    with pytest.raises(ValueError, match=r"model.norm.weight is stored with shape \(32,\), the model expects \(3,\)"):
        fill_from_safetensors(model)
    untied = empty_policy(model_folder)
    untied.name_or_path = tied_folder  # its files hold no lm_head
    with pytest.raises(KeyError, match="no weights for lm_head.weight"):
        fill_from_safetensors(untied)


def test_configure_model_loads_in_full_outside_a_meta_context_and_only_once(model_folder):
    grpo = grpo_module(model_folder)
    assert grpo.policy is None and grpo.tokenizer is not None  # the tokenizer is loaded at once, the weights not
    grpo.configure_model()
    policy = grpo.policy
    assert not is_empty(policy) and policy.training
    grpo.configure_model()  # Lightning may call it again (fit, then validate): it keeps the model
    assert grpo.policy is policy and grpo.reference is None


def test_configure_model_under_the_meta_device_builds_policy_and_reference_empty(model_folder):
    from lightning_logra.modules import LossConfig

    grpo = grpo_module(model_folder, loss=LossConfig(kl_coef=0.1))
    with torch.device("meta"):
        grpo.configure_model()
    assert is_empty(grpo.policy) and is_empty(grpo.reference)
    assert grpo.policy.training and not grpo.reference.training
    assert not any(p.requires_grad for p in grpo.reference.parameters())
    assert grpo.policy.generation_config.pad_token_id == grpo.tokenizer.pad_token_id


def test_a_model_built_from_a_config_gets_its_own_initialisation(model_folder):
    from transformers import AutoConfig

    from lightning_logra.models.sharded_loading import materialize

    config = AutoConfig.from_pretrained(model_folder)
    fresh = AutoModelForCausalLM.from_config(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)  # no files: name_or_path is empty
    materialize(model)
    assert not is_empty(model)
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
    assert torch.equal(model.model.rotary_emb.inv_freq, fresh.model.rotary_emb.inv_freq)
    std = model.model.embed_tokens.weight.std().item()
    assert abs(std - config.initializer_range) < 0.2 * config.initializer_range  # random, not left empty
