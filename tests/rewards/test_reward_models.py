"""Learned reward models as reward sources (issue 44 part 2): a small random one-label
sequence classifier of the quickstart model's architecture (Llama), built offline, scores
prompt + completion exactly as a direct forward of each text alone does, padded or cut, in
any batch size, and runs through RewardRunner and GRPOModule like any reward function."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from lightning_logra.planning.step_memory import StepSettings, step_memory
from lightning_logra.rewards.models import SequenceClassifierReward
from lightning_logra.rewards.runner import RewardRunner
from tests.helpers.architectures import VOCAB
from tests.helpers.models import byte_tokenizer, tiny_qwen2


def reward_model_folder(folder, labels: int = 1) -> str:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=labels)
    model, tokenizer = LlamaForSequenceClassification(config).eval(), byte_tokenizer(folder)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder / "reward-model")
    tokenizer.save_pretrained(folder / "reward-model")
    return str(folder / "reward-model")


@pytest.fixture(scope="module")
def reward_folder(tmp_path_factory):
    return reward_model_folder(tmp_path_factory.mktemp("rm"))


def alone(reward: SequenceClassifierReward, text: str, max_length: int | None = None) -> float:
    ids = reward.tokenizer(text, add_special_tokens=False)["input_ids"][:max_length]
    with torch.no_grad():
        return float(reward.model(input_ids=torch.tensor([ids])).logits[0, 0])


PROMPTS = ["What is 2 + 2?", "Name a colour.", "Hi"]
COMPLETIONS = ["4", "A long answer: the colour of the sky on a clear day is blue.", "Hello there"]


def test_scores_equal_a_forward_of_each_text_alone_padded_or_cut(reward_folder):
    reward = SequenceClassifierReward(reward_folder, device="cpu")
    assert reward.__name__ == "reward_model_reward_model" and reward.dtype == torch.float32
    texts = reward.texts(PROMPTS, COMPLETIONS)
    # The byte tokenizer has a chat template: string prompts are rendered as a user turn.
    assert texts[0] == reward.tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPTS[0]}, {"role": "assistant", "content": COMPLETIONS[0]}], tokenize=False)
    scores = reward(COMPLETIONS, prompts=PROMPTS, answer=["4", None, None])
    assert scores == pytest.approx([alone(reward, text) for text in texts], abs=1e-5)
    assert len({round(s, 6) for s in scores}) == 3  # distinct texts, distinct scores
    in_twos = SequenceClassifierReward(reward_folder, device="cpu", batch_size=2)
    assert in_twos(COMPLETIONS, prompts=PROMPTS) == pytest.approx(scores, abs=1e-5)
    cut = SequenceClassifierReward(reward_folder, device="cpu", max_length=12)
    assert cut(COMPLETIONS, prompts=PROMPTS) == pytest.approx([alone(cut, text, 12) for text in texts], abs=1e-5)


def test_conversational_rows_are_rendered_with_the_completion_as_the_assistant_turn(reward_folder):
    reward = SequenceClassifierReward(reward_folder, device="cpu")
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}]
    completion = [{"role": "assistant", "content": "4"}]
    assert reward.texts([prompt], [completion]) == [reward.tokenizer.apply_chat_template(prompt + completion,
                                                                                         tokenize=False)]


def test_a_reward_model_runs_through_the_runner_by_its_folder_and_is_held_in_the_step_memory(reward_folder, tmp_path):
    runner = RewardRunner([reward_folder], model_options={"device": "cpu", "batch_size": 2})
    scores = runner(COMPLETIONS, prompts=PROMPTS)
    direct = SequenceClassifierReward(reward_folder, device="cpu")(COMPLETIONS, prompts=PROMPTS)
    assert list(scores.per_function) == ["reward_model_reward_model"]
    assert scores.total == pytest.approx(direct, abs=1e-5) and scores.failures == 0
    reward = runner.functions[0]
    assert reward.weight_bytes() == 4 * sum(p.numel() for p in reward.model.parameters())
    memory = step_memory(tiny_qwen2(), StepSettings(method="logra", tokens=64, reward_model_bytes=reward.weight_bytes()))
    assert memory.reward_models == reward.weight_bytes() and memory.held >= reward.weight_bytes()
    with pytest.raises(ValueError, match="has 2 labels; a reward model scores each text with one"):
        SequenceClassifierReward(reward_model_folder(tmp_path, labels=2), device="cpu")


def test_grpo_logs_the_reward_model_as_a_reward_function(model_folder, reward_folder):
    from tests.helpers.grpo import fit_grpo, grpo_module

    from lightning_logra.rewards.config import RewardConfig

    grpo = grpo_module(model_folder, reward=RewardConfig(functions=[reward_folder], model_device="cpu"))
    _, logged = fit_grpo(grpo, model_folder, steps=1)
    assert logged[0]["reward/mean"] == pytest.approx(logged[0]["reward/reward_model_reward_model/mean"])


def favouring_judge_folder(folder, symbol: str) -> str:
    """A tiny random Qwen2 whose head scores every token 0 but one byte symbol, pointed along
    the mean hidden state: greedy decoding writes that symbol every step."""
    from tests.helpers.models import favour_token

    tokenizer = byte_tokenizer(folder)
    model = tiny_qwen2(vocab_size=len(tokenizer))
    with torch.no_grad():
        model.lm_head.weight.zero_()
        favour_token(model, tokenizer.convert_tokens_to_ids(symbol), strength=50.0)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder / "judge")
    tokenizer.save_pretrained(folder / "judge")
    return str(folder / "judge")


def test_a_generative_judge_scores_the_first_verdict_word_of_its_greedy_answer(tmp_path):
    from lightning_logra.rollout.judge import JudgeReward

    folder = favouring_judge_folder(tmp_path, "y")
    judge = JudgeReward(folder, "Is {completion} the answer to {prompt} (expected {answer})? Say y or n.",
                        {"y": 1.0, "n": 0.0}, device="cpu", max_new_tokens=4, batch_size=2)
    assert judge.__name__ == "judge_judge"
    questions = judge.questions(["2 + 2?"], ["4"], {"answer": ["4"]})
    assert "Is 4 the answer to 2 + 2? (expected 4)? Say y or n." in questions[0]
    assert questions[0].endswith("<|im_start|>assistant\n")  # asked as a user turn, the answer to come
    # Three samples in batches of two, generated greedily: "y!y!" each time (the other
    # steps' logits are all 0: the first token, "!", wins the tie).
    assert judge(["4", "5", "6"], prompts=["2 + 2?"] * 3, answer=["4"] * 3) == [1.0, 1.0, 1.0]
    assert judge.verdict("I think N. y would be wrong") == 0.0  # the first verdict word, any case
    assert judge.verdict("yes or no") is None  # whole words only: unscored, counted as such
    unsure = JudgeReward(folder, "{completion}?", {"yes": 1.0, "no": 0.0}, device="cpu", max_new_tokens=4)
    scores = RewardRunner([unsure])(["4", "5"], prompts=["2 + 2?"] * 2)
    assert scores.per_function["judge_judge"] == [None, None] and scores.unscored == 2
    # A checkpoint holds its arguments, not its weights, and loads it under weights_only.
    import io

    buffer = io.BytesIO()
    torch.save({"functions": [judge]}, buffer)
    assert buffer.tell() < 4096
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["functions"][0]
    assert loaded.arguments == judge.arguments and loaded(["4"], prompts=["2 + 2?"], answer=["4"]) == [1.0]
    with pytest.raises(ValueError, match="must show the judge the"):
        JudgeReward(folder, "{prompt}", device="cpu")
