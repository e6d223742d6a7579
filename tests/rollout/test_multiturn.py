"""Multi-turn rollouts with tools on the HF engine: a tiny random model whose turns are
scripted (forced tokens; its log-probs stay its own), checked token by token."""

import pytest
import torch

from lightning_logra.rewards import RewardRunner
from lightning_logra.rl.logprobs import sequence_logprobs
from lightning_logra.rl.sampling import score_rollouts
from lightning_logra.rollout import HFRolloutEngine, select_rows
from lightning_logra.rollout.multiturn import MultiTurnRollouts
from lightning_logra.tools import Environments, ToolChat, ToolRunner, tool_schema
from tests.helpers.models import byte_tokenizer, tiny_qwen2
from tests.helpers.tools import GuessEnvironment, ScriptedGeneration, add, broken

PROMPTS = [[{"role": "user", "content": "2+3?"}], [{"role": "user", "content": "What is 12 + 30?"}]]
CALL = '<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'
# Turn 1 of the four rows [p0 g0, p0 g1, p1 g0, p1 g1]: three call a tool (the last a broken
# one), one answers at once; turn 2: the three that called answer.
TURN_1 = [CALL.format(name="add", arguments='{"a": 2, "b": 3}'), "7",
          CALL.format(name="add", arguments='{"a": 12, "b": 30}'), CALL.format(name="broken", arguments='{"x": 1}')]
TURN_2 = ["5", "42", "sorry"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return byte_tokenizer(tmp_path_factory.mktemp("tok"))


def sampler(tokenizer, *, max_turns=3, max_tokens=400, tools=(add, broken)):
    return MultiTurnRollouts(ToolChat(tokenizer), ToolRunner(timeout_s=5.0, max_hung_calls=1), tools=list(tools),
                             max_turns=max_turns, max_tokens=max_tokens)


def scripted_run(tokenizer, turns, **options):
    model = tiny_qwen2(vocab_size=len(tokenizer))
    script = ScriptedGeneration(model, tokenizer, turns)
    engine = HFRolloutEngine(model, tokenizer, max_new_tokens=400)
    rollouts = sampler(tokenizer, **options).generate(engine, PROMPTS, [{}, {}], num_generations=2)
    return model, script, rollouts


@pytest.fixture(scope="module")
def two_turns(tokenizer):
    """The model, its script and the rollouts of TURN_1 then TURN_2."""
    return scripted_run(tokenizer, [TURN_1, TURN_2])


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def test_trainer_tokens_are_the_engines_turn_by_turn(tokenizer, two_turns):
    model, script, rollouts = two_turns
    chat = ToolChat(tokenizer)
    prompts = script.inputs[0]
    assert prompts == [chat.prompt_ids(PROMPTS[row // 2], [tool_schema(add), tool_schema(broken)]) for row in range(4)]
    # Turn 2 is generated from exactly prompt + turn 1 as sampled + the tool turn's tokens.
    tool_turn = {row: script.inputs[1][index][len(prompts[row]) + len(encode(tokenizer, TURN_1[row])):]
                 for index, row in enumerate([0, 2, 3])}
    for index, row in enumerate([0, 2, 3]):
        assert script.inputs[1][index] == prompts[row] + encode(tokenizer, TURN_1[row]) + tool_turn[row]
    assert tokenizer.decode(tool_turn[0]) == ("\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
                                              "<|im_start|>assistant\n")
    assert "Error: tool 'broken' raised RuntimeError: broken on 1" in tokenizer.decode(tool_turn[3])
    # The rows the trainer scores: those token lists, then turn 2 as sampled.
    expected = {0: script.inputs[1][0] + encode(tokenizer, "5"), 1: prompts[1] + encode(tokenizer, "7"),
                2: script.inputs[1][1] + encode(tokenizer, "42"), 3: script.inputs[1][2] + encode(tokenizer, "sorry")}
    for row in range(4):
        assert rollouts.input_ids[row][rollouts.attention_mask[row].bool()].tolist() == expected[row]
    assert rollouts.completion_text == ["5", "7", "42", "sorry"]
    assert rollouts.ended_with_eos.tolist() == [True] * 4


def test_only_generated_tokens_are_trained_and_scored(tokenizer, two_turns):
    model, script, rollouts = two_turns
    width, start = rollouts.input_ids.shape[1], rollouts.prompt_length
    for row, turn_2 in zip([0, 1, 2, 3], ["5", None, "42", "sorry"]):
        generated_1 = len(encode(tokenizer, TURN_1[row]))
        tool = 0 if turn_2 is None else len(script.inputs[1][[0, 2, 3].index(row)]) - len(script.inputs[0][row]) - generated_1
        generated_2 = 0 if turn_2 is None else len(encode(tokenizer, turn_2))
        padding = width - start - generated_1 - tool - generated_2
        assert rollouts.completion_mask[row].tolist() == [0] * start + [1] * generated_1 + [0] * tool + [1] * generated_2 \
            + [0] * padding
        assert rollouts.environment_mask[row].tolist() == [0] * (start + generated_1) + [1] * tool \
            + [0] * (generated_2 + padding)
        prompt_padding = start - len(script.inputs[0][row])
        assert rollouts.attention_mask[row].tolist() == [0] * prompt_padding + [1] * (width - prompt_padding - padding) \
            + [0] * padding
    # Log-probs only where the model sampled, and they are the trainer's (the same tokens).
    generated = rollouts.completion_mask.bool()
    assert (rollouts.rollout_logprobs[~generated] == 0).all() and (rollouts.rollout_logprobs[generated] < 0).all()
    trainer = sequence_logprobs(model, rollouts.input_ids, rollouts.attention_mask, temperature=1.0)
    mask = generated[:, 1:]
    torch.testing.assert_close(trainer[mask], rollouts.rollout_logprobs[:, 1:][mask], atol=1e-4, rtol=0)
    counts = [(c.turns, c.tool_calls, c.tool_failures) for c in rollouts.conversations]
    assert counts == [(2, 1, 0), (1, 0, 0), (2, 1, 0), (2, 1, 1)]


def test_selected_rows_keep_tool_tokens_as_context(tokenizer, two_turns):
    _, _, rollouts = two_turns
    chosen = select_rows([(rollouts, [3, 0])], pad_token_id=tokenizer.pad_token_id)
    for new, old in ((0, 3), (1, 0)):
        for field in ("completion_mask", "environment_mask", "rollout_logprobs"):
            kept, original = getattr(chosen, field)[new], getattr(rollouts, field)[old]
            assert kept[chosen.attention_mask[new].bool()].tolist() == original[rollouts.attention_mask[old].bool()].tolist()
    assert [c.tool_failures for c in chosen.conversations] == [1, 0]


def test_a_row_whose_tool_turn_leaves_no_room_ends_at_the_budget(tokenizer):
    first = len(encode(tokenizer, TURN_1[0]))
    _, script, rollouts = scripted_run(tokenizer, [TURN_1, TURN_2], max_tokens=first + 10)
    assert len(script.inputs) == 1  # no row had room for a second turn
    assert rollouts.ended_with_eos.tolist() == [False, True, False, False]
    assert rollouts.environment_mask.sum().item() == 0
    assert [c.tool_calls for c in rollouts.conversations] == [1, 0, 1, 1]


def test_tool_calls_of_the_last_turn_are_not_run(tokenizer):
    _, script, rollouts = scripted_run(tokenizer, [TURN_1], max_turns=1)
    assert len(script.inputs) == 1
    assert [c.tool_calls for c in rollouts.conversations] == [0, 0, 0, 0]
    assert rollouts.ended_with_eos.tolist() == [True] * 4
    assert rollouts.completion_text[0] == TURN_1[0]


def test_an_environment_per_rollout_gives_tools_prompt_text_and_a_reward(tokenizer):
    model = tiny_qwen2(vocab_size=len(tokenizer))
    script = ScriptedGeneration(model, tokenizer, [
        [CALL.format(name="guess", arguments=f'{{"number": {n}}}') for n in (4, 2, 30, 42)],
        "done"])
    engine = HFRolloutEngine(model, tokenizer, max_new_tokens=400)
    multi_turn = MultiTurnRollouts(ToolChat(tokenizer), ToolRunner(timeout_s=5.0, max_hung_calls=1),
                                   environments=Environments(GuessEnvironment), max_turns=2, max_tokens=400)
    batch = {"prompt_text": ["unused", "unused"], "prompt": [p[0]["content"] for p in PROMPTS], "answer": ["4", "42"]}
    rollouts = multi_turn.generate(engine, PROMPTS, [{"answer": "4"}, {"answer": "42"}], num_generations=2)
    assert "2+3? Guess my number.<|im_end|>" in tokenizer.decode(script.inputs[0][0])
    assert [c.messages[1]["content"] for c in rollouts.conversations] == ["right", "higher", "higher", "right"]
    seen = {}

    def answer_length(completions, transcripts, **columns):
        seen["transcripts"] = transcripts
        return [float(len(c)) for c in completions]

    scores, _ = score_rollouts(RewardRunner([answer_length]), rollouts, batch, n=2)
    assert scores.per_function == {"answer_length": [4.0] * 4, "GuessEnvironment": [1.0, 0.0, 0.0, 1.0]}
    assert scores.total == [5.0, 4.0, 4.0, 5.0]
    assert seen["transcripts"][0] == [
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "guess", "arguments": {"number": 4}}}]},
        {"role": "tool", "name": "guess", "content": "right"},
        {"role": "assistant", "content": "done"},
    ]


def test_a_failing_environment_reward_is_counted_not_raised(tokenizer):
    class Failing(GuessEnvironment):
        def get_reward(self) -> float:
            raise ValueError("no score")

    model = tiny_qwen2(vocab_size=len(tokenizer))
    ScriptedGeneration(model, tokenizer, ["no guess"])
    multi_turn = MultiTurnRollouts(ToolChat(tokenizer), ToolRunner(timeout_s=5.0, max_hung_calls=1),
                                   environments=Environments(Failing), max_turns=2, max_tokens=400)
    rollouts = multi_turn.generate(HFRolloutEngine(model, tokenizer, max_new_tokens=400), PROMPTS[:1], [{"answer": "1"}],
                                   num_generations=2)
    batch = {"prompt_text": ["unused"], "prompt": ["2+3?"], "answer": ["1"]}
    scores, _ = score_rollouts(RewardRunner([lambda completions, **columns: [None, 1.0]]), rollouts, batch, n=2)
    assert scores.per_function["Failing"] == [None, None]
    assert (scores.failures, scores.unscored, scores.total) == (2, 0, [0.0, 1.0])


def test_the_tools_listing_is_counted_against_the_models_positions(tokenizer):
    multi_turn = sampler(tokenizer)
    plain = tokenizer.apply_chat_template(PROMPTS[0], tokenize=False, add_generation_prompt=True)
    listed = len(multi_turn.chat.prompt_ids(PROMPTS[0], multi_turn.schemas))
    assert multi_turn.tool_prompt_tokens() == listed - len(tokenizer(plain, add_special_tokens=False)["input_ids"])
    assert multi_turn.tool_prompt_tokens() > 300  # the two schemas and the instruction, byte tokens
