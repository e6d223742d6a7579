"""Chat data for SFT: the built-in calculator conversations, held out from the tool task's
validation prompts, and conversations tokenised exactly as multi-turn rollouts lay them out."""

import re

import pytest
import torch

from lightning_logra.data import ConversationDataModule, PromptDataModule, calculator_conversations
from lightning_logra.data.conversations import conversation_tokens, messages_problem
from lightning_logra.data.held_out import prompt_split
from lightning_logra.tools.calculator import calculator
from lightning_logra.tools.calls import parse_tool_calls
from lightning_logra.tools.execution import ToolRunner
from lightning_logra.tools.schema import tool_schema
from lightning_logra.tools.template import ToolChat

INSTRUCTION = " Use the calculator tool, then answer with just the number."


def test_calculator_conversations_call_the_tool_correctly_and_are_reproducible():
    rows = calculator_conversations(20, seed=3)
    assert rows == calculator_conversations(20, seed=3)
    assert rows != calculator_conversations(20, seed=4)
    for row in rows:
        user, call, result, answer = row["messages"]
        expression = call["tool_calls"][0]["function"]["arguments"]["expression"]
        assert user == {"role": "user", "content": f"What is {expression}?"}
        assert result == {"role": "tool", "name": "calculator", "content": calculator(expression)}
        assert answer == {"role": "assistant", "content": row["answer"]} and result["content"] == row["answer"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_calculator_conversations_never_use_a_validation_prompt_of_the_tool_task(seed, model_folder):
    sft = {row["prompt"] for row in calculator_conversations(400, seed=seed)}
    assert all(prompt_split(prompt) == "train" for prompt in sft)
    for rl_seed in (0, 1, 2):  # the RL task's validation prompts, whatever seed the RL run uses
        rl = PromptDataModule(train="arithmetic:3", val="arithmetic:3", tokenizer=model_folder, train_size=8,
                              val_size=400, seed=rl_seed)
        rl.setup()
        assert not sft & {row["prompt"] for row in rl.datasets["val"].columns}


def test_conversation_tokens_are_the_rollouts_tokens_and_only_assistant_turns_train(model_folder):
    data = ConversationDataModule("calculator:2", tokenizer=model_folder, tools=["lightning_logra.tools:calculator"],
                                  instruction=INSTRUCTION, train_size=4)
    data.setup()
    chat, schemas = ToolChat(data.tokenizer), [tool_schema(calculator)]
    messages = calculator_conversations(4, seed=0, max_digits=2)[0]["messages"]
    messages[0] = {**messages[0], "content": messages[0]["content"] + INSTRUCTION}
    ids, trained = conversation_tokens(chat, messages, schemas)
    assert (ids, trained) == (data.datasets["train"][0]["input_ids"].tolist(),
                              data.datasets["train"][0]["loss_mask"].tolist())

    # What a rollout holds: the prompt's tokens, the generated call and its end-of-turn token,
    # the tool turn's tokens (ToolChat.tool_turn_ids), the generated answer and its end of turn.
    eos = data.tokenizer.eos_token_id
    prompt = chat.prompt_ids(messages[:1], schemas)
    call_text = data.tokenizer.decode(ids[len(prompt):ids.index(eos, len(prompt))])
    _, calls = parse_tool_calls(call_text)
    results = [ToolRunner(5.0, 1).call(call, {"calculator": calculator}).as_message() for call in calls]
    tool_turn = chat.tool_turn_ids(calls, results, schemas)
    answer = chat.encode(messages[3]["content"]) + [eos]
    call = ids[len(prompt):ids.index(eos, len(prompt)) + 1]
    assert ids == prompt + call + tool_turn + answer
    assert trained == [False] * len(prompt) + [True] * len(call) + [False] * len(tool_turn) + [True] * len(answer)
    assert call_text.startswith("<tool_call>") and calls[0].arguments == messages[1]["tool_calls"][0]["function"]["arguments"]


def test_batches_are_right_padded_with_nothing_trained_on_padding(model_folder):
    data = ConversationDataModule("calculator:1", tokenizer=model_folder, tools=["lightning_logra.tools:calculator"],
                                  batch_size=4, train_size=8)
    data.setup()
    batch = next(iter(data.train_dataloader()))
    lengths = batch["attention_mask"].sum(dim=1)
    assert lengths.max() == batch["input_ids"].shape[1] and lengths.min() < lengths.max()
    padding = ~batch["attention_mask"].bool()
    assert not batch["loss_mask"][padding].any()
    assert (batch["input_ids"][padding] == data.tokenizer.pad_token_id).all()
    assert batch["loss_mask"].dtype == torch.bool and batch["loss_mask"].sum(dim=1).min() > 0


def test_a_file_of_conversations_with_a_bad_row_is_refused_naming_the_row_or_skipped(tmp_path, model_folder):
    path = tmp_path / "chats.jsonl"
    good = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}'
    bad = '{"messages": [{"role": "user", "content": "hi"}]}'
    path.write_text("\n".join([good, bad, good]) + "\n")
    with pytest.raises(ValueError, match=r"chats.jsonl: train row 1: the conversation has no assistant turn"):
        ConversationDataModule(str(path), tokenizer=model_folder).setup()
    data = ConversationDataModule(str(path), tokenizer=model_folder, skip_invalid_rows=True, batch_size=2)
    data.setup()
    assert len(data.datasets["train"]) == 2 and data.skipped["train"] == {"invalid": 1, "too_long": 0}


@pytest.mark.parametrize("messages, problem", [
    ([], "non-empty list"),
    ([{"role": "robot", "content": "x"}], r"messages\[0\]' needs a 'role'"),
    ([{"role": "user", "content": 3}], r"messages\[0\]' needs a string 'content'"),
    ([{"role": "assistant", "content": "x"}], "starts with an assistant turn"),
    ([{"role": "user", "content": "x"}, {"role": "tool", "content": "1", "tool_calls": []}], "on an assistant message"),
])
def test_malformed_conversations_are_named(messages, problem):
    assert messages_problem(messages) is not None
    assert re.search(problem, messages_problem(messages))


def test_validation_conversations_that_share_a_training_prompt_are_refused(tmp_path, model_folder):
    path = tmp_path / "chats.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}]}\n' * 2)
    data = ConversationDataModule(str(path), str(path), tokenizer=model_folder, batch_size=2)
    with pytest.raises(ValueError, match="2 validation conversations .* start from a prompt of the training"):
        data.setup()


def test_conversations_longer_than_max_tokens_are_dropped_and_counted(model_folder):
    data = ConversationDataModule("calculator:1", tokenizer=model_folder, batch_size=2, train_size=8, max_tokens=60)
    with pytest.raises(ValueError, match="no usable train conversations"):
        data.setup()
    assert data.skipped["train"] == {"invalid": 0, "too_long": 8}


def test_an_instruction_with_no_user_turn_before_the_first_answer_names_the_row(tmp_path, model_folder):
    path = tmp_path / "chats.jsonl"
    path.write_text('{"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]}\n')
    with pytest.raises(ValueError, match=r"chats.jsonl: train row 0: instruction ' Be brief.': a prompt has no 'user'"):
        ConversationDataModule(str(path), tokenizer=model_folder, instruction=" Be brief.").setup()
