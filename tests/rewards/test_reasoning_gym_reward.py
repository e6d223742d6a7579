"""reasoning_gym_reward: each row scored by its own reasoning-gym task's score_answer, with
the entry's metadata from the data source."""

import pytest

from lightning_logra.data import reasoning_gym_rows
from lightning_logra.rewards import reasoning_gym_reward
from lightning_logra.rewards.reasoning_gym import final_answer


def columns(rows):
    return {"task": [r["task"] for r in rows], "answer": [r["answer"] for r in rows],
            "metadata": [r["metadata"] for r in rows]}


def test_a_task_scorer_that_reads_metadata_gets_the_entry_the_source_made():
    rows = reasoning_gym_rows("word_sorting", 2, seed=3)
    right = [r["answer"] for r in rows]
    # word_sorting compares with metadata["sorted_words"], not with the answer column.
    assert reasoning_gym_reward(right, **columns(rows)) == [1.0, 1.0]
    reversed_words = ", ".join(reversed(rows[0]["answer"].split(", ")))
    # The right words in another order: the task's own partial credit (0.2 when nothing is in place).
    assert reasoning_gym_reward([reversed_words], **columns(rows[:1])) == [pytest.approx(0.2, abs=0.2)]


def test_exact_tasks_score_one_the_answer_line_and_zero_a_sentence():
    rows = reasoning_gym_rows("family_relationships", 1, seed=3)
    answer = rows[0]["answer"]
    completions = [answer, f"{answer.capitalize()}.\nBecause ...", f"<answer>{answer}</answer>", f"They are {answer}s"]
    assert reasoning_gym_reward(completions, **columns(rows * 4)) == [1.0, 1.0, 1.0, 0.0]


def test_conversational_completions_and_rows_of_other_sources():
    rows = reasoning_gym_rows("family_relationships", 1, seed=3)
    answer = rows[0]["answer"]
    scores = reasoning_gym_reward([[{"role": "assistant", "content": answer}], "7"],
                                  task=[rows[0]["task"], None], answer=[answer, "7"], metadata=[rows[0]["metadata"], None])
    assert scores == [1.0, None]  # the arithmetic row is not a reasoning-gym row: unscored


def test_missing_columns_name_what_is_needed():
    with pytest.raises(TypeError, match="'task' and 'answer' columns"):
        reasoning_gym_reward(["1"], answer=["1"])
    with pytest.raises(ValueError, match="2 completions, 1 tasks and 1 answers"):
        reasoning_gym_reward(["1", "2"], task=["letter_counting"], answer=["1"])


def test_final_answer_prefers_answer_tags_then_the_first_line():
    assert final_answer("  wife.  \nmore") == "wife"
    assert final_answer("think <answer> 3 </answer> <answer>4</answer>") == "4"
    assert final_answer("\n\n") == ""
