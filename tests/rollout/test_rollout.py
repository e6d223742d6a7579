import importlib.util

import inspect

import pytest
import torch
from transformers.generation.logits_process import TopPLogitsWarper

from lightning_logra.rl.logprobs import sequence_logprobs
from lightning_logra.rollout import HFRolloutEngine, Rollouts, VLLMRolloutEngine, pack_rollouts, select_rows
from tests.helpers.models import byte_tokenizer, favour_token, tiny_qwen2

PROMPTS = ["What is 2 + 3?", "Hi"]  # 14 and 2 byte tokens: the second is left-padded


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return byte_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def model(tokenizer):
    model = tiny_qwen2(vocab_size=len(tokenizer))
    favour_token(model, tokenizer.eos_token_id, 1.5)  # about 1 in 4 completions of 8 tokens stop early
    return model


def test_byte_tokenizer_round_trips_text(tokenizer):
    text = "Tom has  3 apples.\nHe eats one;\tthen 2 are left — ok?"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert len(tokenizer) == 259
    assert tokenizer.convert_ids_to_tokens([256, 257, 258]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def test_pack_rollouts_lays_out_rows():
    rollouts = pack_rollouts(
        prompt_ids=[[5, 6], [7]],
        completion_ids=[[1, 2, 9], [3]],
        completion_logprobs=[[-0.5, -1.0, -0.25], [-2.0]],
        completion_text=["ab", "c"],
        ended_with_eos=[True, False],
        pad_token_id=0,
    )
    assert rollouts.prompt_length == 2
    assert rollouts.input_ids.tolist() == [[5, 6, 1, 2, 9], [0, 7, 3, 0, 0]]
    assert rollouts.attention_mask.tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 0, 0]]
    assert rollouts.completion_mask.tolist() == [[0, 0, 1, 1, 1], [0, 0, 1, 0, 0]]
    assert rollouts.rollout_logprobs.tolist() == [[0, 0, -0.5, -1.0, -0.25], [0, 0, -2.0, 0, 0]]
    assert rollouts.ended_with_eos.tolist() == [True, False]
    assert rollouts.completion_text == ["ab", "c"]


def test_pack_rollouts_rejects_mismatched_rows():
    with pytest.raises(ValueError, match="row 0: 2 completion tokens but 1 log-probs"):
        pack_rollouts([[1]], [[1, 2]], [[-1.0]], ["x"], [False], pad_token_id=0)
    with pytest.raises(ValueError, match="same non-zero number"):
        pack_rollouts([[1]], [], [], [], [], pad_token_id=0)


def recomputed_logprobs(model, rollouts: Rollouts, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """log p(token t | tokens before) from one plain forward over the returned sequences."""
    mask = rollouts.attention_mask
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=rollouts.input_ids, attention_mask=mask, position_ids=position_ids).logits
    scores = logits[:, :-1].float() / temperature
    if top_p < 1:
        flat = scores.reshape(-1, scores.shape[-1])
        scores = TopPLogitsWarper(top_p)(None, flat).reshape(scores.shape)
    logprobs = torch.log_softmax(scores, dim=-1).gather(-1, rollouts.input_ids[:, 1:, None]).squeeze(-1)
    logprobs = torch.cat([torch.zeros(logprobs.shape[0], 1), logprobs], dim=1)
    return torch.where(rollouts.completion_mask.bool(), logprobs, 0.0)  # prompt tokens may be outside a nucleus


@pytest.fixture(scope="module")
def rollouts(model, tokenizer):
    torch.manual_seed(0)
    model.train()  # the engine must generate in eval mode and restore this
    engine = HFRolloutEngine(model, tokenizer, max_new_tokens=8, temperature=0.7)
    result = engine.generate(PROMPTS, num_generations=3)
    assert model.training
    model.eval()
    return result


def test_both_engines_implement_the_whole_engine_protocol(model, tokenizer):
    from lightning_logra.rollout.base import RolloutEngine

    engine = HFRolloutEngine(model, tokenizer, max_new_tokens=8)
    assert isinstance(engine, RolloutEngine) and engine.last_sync_bytes is None
    engine.sync_weights(model, low_rank_updates=[])  # the same call GRPOModule makes of vLLM
    # vLLM's engine needs vLLM to construct (tests/integration/test_vllm_cpu.py checks an
    # instance); its methods take what the Protocol's do.
    for name in ("generate", "sync_weights"):
        expected = list(inspect.signature(getattr(RolloutEngine, name)).parameters)
        assert list(inspect.signature(getattr(VLLMRolloutEngine, name)).parameters)[: len(expected)] == expected


def test_hf_rollouts_layout_and_group_order(rollouts, tokenizer):
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    assert rollouts.prompt_length == 14
    assert rollouts.input_ids.shape == (6, 14 + 8)
    for row in range(6):
        prompt = prompt_ids[row // 3]  # [p0, p0, p0, p1, p1, p1]
        padding = 14 - len(prompt)
        assert rollouts.input_ids[row, padding:14].tolist() == prompt
        assert rollouts.input_ids[row, :padding].tolist() == [tokenizer.pad_token_id] * padding
        assert rollouts.attention_mask[row, :14].tolist() == [0] * padding + [1] * len(prompt)


def test_hf_rollouts_stop_at_the_first_eos(rollouts, tokenizer):
    eos = tokenizer.eos_token_id
    lengths = rollouts.completion_mask.sum(dim=1)
    # With this seed some completions stop early and some hit max_new_tokens.
    assert rollouts.ended_with_eos.tolist() == [False, True, True, False, True, False]
    for row in range(6):
        n = int(lengths[row])
        completion = rollouts.input_ids[row, 14:].tolist()
        assert rollouts.completion_mask[row].tolist() == [0] * 14 + [1] * n + [0] * (8 - n)
        assert rollouts.attention_mask[row, 14:].tolist() == [1] * n + [0] * (8 - n)
        if rollouts.ended_with_eos[row]:
            assert completion.index(eos) == n - 1  # the EOS is the last trained-on token
            assert completion[n:] == [tokenizer.pad_token_id] * (8 - n)
        else:
            assert n == 8 and eos not in completion
        assert rollouts.completion_text[row] == tokenizer.decode(completion[:n], skip_special_tokens=True)
    assert (rollouts.rollout_logprobs[rollouts.completion_mask == 0] == 0).all()


def test_hf_rollout_logprobs_match_a_plain_forward(model, rollouts):
    torch.testing.assert_close(rollouts.rollout_logprobs, recomputed_logprobs(model, rollouts, 0.7), rtol=0, atol=1e-5)


def test_hf_rollout_logprobs_line_up_with_sequence_logprobs(model, rollouts):
    with torch.no_grad():
        trainer = sequence_logprobs(model, rollouts.input_ids, rollouts.attention_mask, temperature=0.7)
    mask = rollouts.completion_mask[:, 1:].bool()
    torch.testing.assert_close(trainer[mask], rollouts.rollout_logprobs[:, 1:][mask], rtol=0, atol=1e-5)


def test_hf_rollout_logprobs_under_top_p_are_those_of_the_full_distribution(model, tokenizer):
    # The trainer scores the untruncated tempered distribution; so does the engine, so the
    # rollout/trainer ratio measures numerical mismatch only.
    torch.manual_seed(1)
    engine = HFRolloutEngine(model, tokenizer, max_new_tokens=6, temperature=1.3, top_p=0.5)
    rollouts = engine.generate(PROMPTS, num_generations=2)
    torch.testing.assert_close(rollouts.rollout_logprobs, recomputed_logprobs(model, rollouts, 1.3), rtol=0, atol=1e-5)
    nucleus = recomputed_logprobs(model, rollouts, 1.3, top_p=0.5)
    completion = rollouts.completion_mask.bool()
    assert (nucleus[completion] > rollouts.rollout_logprobs[completion]).all()  # the nucleus renormalises


def test_hf_top_k_samples_only_the_k_most_likely_tokens(model, tokenizer):
    torch.manual_seed(2)
    engine = HFRolloutEngine(model, tokenizer, max_new_tokens=6, temperature=1.5, top_k=3)
    rollouts = engine.generate(PROMPTS, num_generations=3)
    mask = rollouts.attention_mask
    with torch.no_grad():
        logits = model(input_ids=rollouts.input_ids, attention_mask=mask,
                       position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[:, :-1]
    top3 = logits.topk(3, dim=-1).indices
    sampled = rollouts.input_ids[:, 1:, None]
    completion = rollouts.completion_mask[:, 1:].bool()
    assert (top3 == sampled).any(dim=-1)[completion].all()
    torch.testing.assert_close(rollouts.rollout_logprobs, recomputed_logprobs(model, rollouts, 1.5), rtol=0, atol=1e-5)


def test_rollout_and_trainer_logprobs_agree_at_temperature_1_without_truncation(model, tokenizer):
    torch.manual_seed(3)
    rollouts = HFRolloutEngine(model, tokenizer, max_new_tokens=8).generate(PROMPTS, num_generations=4)
    with torch.no_grad():
        trainer = sequence_logprobs(model, rollouts.input_ids, rollouts.attention_mask, temperature=1.0)
    mask = rollouts.completion_mask[:, 1:].bool()
    gap = (trainer - rollouts.rollout_logprobs[:, 1:])[mask].abs()
    assert gap.max() < 1e-5  # float32 round-off of two forwards of differing batch shapes


def test_select_rows_lays_out_chosen_rows_of_several_rollouts_anew():
    wide = pack_rollouts([[5, 6, 7], [8]], [[1, 2], [3, 4, 9]], [[-0.5, -1.0], [-2.0, -0.25, -3.0]], ["ab", "cd"],
                         [True, False], pad_token_id=0)
    narrow = pack_rollouts([[4]], [[2]], [[-1.5]], ["e"], [True], pad_token_id=0)
    picked = select_rows([(wide, [1]), (narrow, [0])], pad_token_id=0)
    expected = pack_rollouts([[8], [4]], [[3, 4, 9], [2]], [[-2.0, -0.25, -3.0], [-1.5]], ["cd", "e"], [False, True], pad_token_id=0)
    for field in ("input_ids", "attention_mask", "completion_mask", "rollout_logprobs", "ended_with_eos"):
        assert torch.equal(getattr(picked, field), getattr(expected, field)), field
    assert picked.completion_text == ["cd", "e"] and picked.prompt_length == 1
    same = select_rows([(wide, [0, 1])], pad_token_id=0)
    assert torch.equal(same.input_ids, wide.input_ids) and torch.equal(same.rollout_logprobs, wide.rollout_logprobs)


def test_hf_greedy_rollouts_are_deterministic(model, tokenizer):
    engine = HFRolloutEngine(model, tokenizer, max_new_tokens=5, do_sample=False)
    first, second = engine.generate(PROMPTS, num_generations=2), engine.generate(PROMPTS, num_generations=2)
    assert torch.equal(first.input_ids, second.input_ids)
    assert torch.equal(first.input_ids[0], first.input_ids[1])  # a group of identical greedy samples
    torch.testing.assert_close(first.rollout_logprobs, recomputed_logprobs(model, first, 1.0), rtol=0, atol=1e-5)


def test_hf_engine_rejects_bad_settings(model, tokenizer):
    with pytest.raises(ValueError, match="top_p"):
        HFRolloutEngine(model, tokenizer, max_new_tokens=4, top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        HFRolloutEngine(model, tokenizer, max_new_tokens=4, top_k=-1)
    with pytest.raises(ValueError, match="temperature"):
        HFRolloutEngine(model, tokenizer, max_new_tokens=4, temperature=0.0)
    with pytest.raises(ValueError, match="num_generations"):
        HFRolloutEngine(model, tokenizer, max_new_tokens=4).generate(PROMPTS, num_generations=0)


HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed")
def test_vllm_engine_without_vllm_says_what_to_install():
    with pytest.raises(ImportError, match=r"pip install lightning-logra\[vllm\]"):
        VLLMRolloutEngine("unused", max_new_tokens=4)


def test_vllm_sync_weights_sends_hf_names_of_a_wrapped_model(tokenizer):
    """Without vLLM: a stand-in LLM records the names ``sync_weights`` loads."""

    class RecordingLLM:
        def __init__(self):
            self.names = []

        def collective_rpc(self, method, kwargs):
            assert method == "reload_weights" and kwargs["is_checkpoint_format"]
            self.names.extend(name for name, _ in kwargs["weights_iterator"])

        def reset_prefix_cache(self):
            pass

    class Wrapper(torch.nn.Module):  # names its child as FSDP1 / activation checkpointing do
        def __init__(self, attribute, module):
            super().__init__()
            setattr(self, attribute, module)

    plain = tiny_qwen2(vocab_size=len(tokenizer))
    inner = tiny_qwen2(vocab_size=len(tokenizer))
    inner.model.layers[0] = Wrapper("_checkpoint_wrapped_module", inner.model.layers[0])
    wrapped = torch.compile(Wrapper("_fsdp_wrapped_module", inner))  # adds _orig_mod; compiles lazily
    name = next(name for name in wrapped.state_dict() if "_checkpoint_wrapped_module" in name)
    assert name.startswith("_orig_mod._fsdp_wrapped_module.model.layers.0._checkpoint_wrapped_module.")
    engine = VLLMRolloutEngine.__new__(VLLMRolloutEngine)  # skips starting vLLM
    engine.llm, engine._weights_asleep = RecordingLLM(), False
    engine.weight_sync, engine._master = "full", None
    engine.check_sync = lambda model: 0.0  # needs a running engine: tests/integration/test_vllm_cpu.py
    engine.sync_weights(wrapped)
    assert engine.llm.names == list(plain.state_dict())


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.skipif(not (HAS_VLLM and torch.cuda.is_available()), reason="needs vLLM and a CUDA GPU")
def test_vllm_engine_samples_and_syncs_weights(tmp_path, tokenizer):
    model = tiny_qwen2(vocab_size=len(tokenizer))
    favour_token(model, tokenizer.eos_token_id, 1.5)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    engine = VLLMRolloutEngine(
        str(tmp_path / "model"), max_new_tokens=8, temperature=0.7, dtype="float32", gpu_memory_utilization=0.1
    )
    rollouts = engine.generate(PROMPTS, num_generations=3)
    assert rollouts.input_ids.shape[0] == 6 and rollouts.prompt_length == 14
    cpu = Rollouts(**{k: v.cpu() if torch.is_tensor(v) else v for k, v in vars(rollouts).items()})
    torch.testing.assert_close(cpu.rollout_logprobs, recomputed_logprobs(model, cpu, 0.7), rtol=0, atol=1e-3)
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] *= 100  # now every completion stops at once
    engine.sync_weights(model)
    assert engine.generate(PROMPTS, num_generations=1).completion_mask.sum(dim=1).tolist() == [1, 1]
