"""Validation prompts are held out: the built-in tasks split their prompts into train and
validation by a hash of the text, whatever the seed, and the data module refuses a run whose
validation prompts are training prompts too."""

import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from lightning_logra.data import PromptDataModule, arithmetic_rows, code_rows, reasoning_gym_rows
from lightning_logra.data.code_tasks import code_prompts
from lightning_logra.data.held_out import prompt_split, split_counts
from lightning_logra.data.sources import arithmetic_prompts

DATA_GUIDE = Path(__file__).parents[2] / "docs" / "guides" / "data.md"
REPEATS = "ignore:.*rows repeat a prompt"  # the small spaces at the quickstart's sizes
SEEDS = (0, 1, 2, 42)

# The built-in sources at the sizes of configs/quickstart*.yaml (train_size 512, val_size 24),
# the defaults (1024, 128), and a reasoning-gym task.
BUILT_IN = [
    ("arithmetic:1", 512, 24),
    ("arithmetic:3", 512, 24),
    ("arithmetic", 1024, 128),
    ("code:1", 512, 24),
    ("code:2", 512, 24),
    ("reasoning_gym:basic_arithmetic", 128, 24),
]


def split_prompts(source, train_size, val_size, seed):
    """The train and validation prompts the data module draws for ``source`` at ``seed``."""
    data = PromptDataModule(source, val=source, train_size=train_size, val_size=val_size, seed=seed)
    data.setup("fit")
    return [[columns["prompt"] for columns in data.datasets[split].columns] for split in ("train", "val")]


@pytest.mark.filterwarnings(REPEATS)
@pytest.mark.parametrize(("source", "train_size", "val_size"), BUILT_IN)
def test_no_validation_prompt_of_a_seed_is_a_training_prompt_of_any_seed(source, train_size, val_size):
    drawn = [split_prompts(source, train_size, val_size, seed) for seed in SEEDS]
    train = {prompt for train_prompts, _ in drawn for prompt in train_prompts}
    val = {prompt for _, val_prompts in drawn for prompt in val_prompts}
    assert not train & val
    assert all(len(val_prompts) == val_size for _, val_prompts in drawn)


@pytest.mark.filterwarnings(REPEATS)
@pytest.mark.parametrize(("source", "train_size", "val_size"), [case for case in BUILT_IN if case[0] != "code:1"])
def test_validation_prompts_differ_across_seeds(source, train_size, val_size):
    first, second = (set(split_prompts(source, train_size, val_size, seed)[1]) for seed in (0, 1))
    assert first != second
    # Drawn apart, not a window shifted by one: reasoning-gym's entry i of seed s is entry i - 1 of s + 1.
    assert len(first & second) < val_size * 3 // 4


@pytest.mark.filterwarnings(REPEATS)
def test_a_split_smaller_than_the_rows_asked_for_has_all_its_prompts_for_every_seed():
    # code:1 has 8 validation prompts: 24 rows hold each of them, in an order of the seed.
    orders = [split_prompts("code:1", 512, 24, seed)[1] for seed in (0, 1)]
    assert set(orders[0]) == set(orders[1]) and len(set(orders[0])) == 8
    assert orders[0] != orders[1]


def test_rows_are_the_same_for_a_seed_and_split_and_of_that_split():
    for split in ("train", "val"):
        rows = arithmetic_rows(30, seed=5, split=split)
        assert rows == arithmetic_rows(30, seed=5, split=split)
        assert {prompt_split(row["prompt"]) for row in rows} == {split}
        assert len({row["prompt"] for row in rows}) == 30
        assert code_rows(5, seed=5, split=split, level=2) == code_rows(5, seed=5, split=split, level=2)


def test_an_unknown_split_is_named():
    with pytest.raises(ValueError, match=r"code:1: split must be 'train' or 'val', got 'test'"):
        code_rows(1, seed=0, split="test")
    with pytest.raises(ValueError, match=r"arithmetic:2 \(2 terms\): split must be 'train' or 'val', got 'validation'"):
        arithmetic_rows(1, seed=0, split="validation")


# Distinct prompts per split of the enumerable spaces, as the data guide gives them.
SMALL_SPACES = {
    "arithmetic:1": (lambda: arithmetic_prompts(terms=2, max_digits=1), 161, 39),
    "arithmetic:2": (lambda: arithmetic_prompts(terms=2, max_digits=2), 16041, 3959),
    "arithmetic:2+": (lambda: arithmetic_prompts(terms=2, max_digits=2, signs="+"), 8003, 1997),
    "code:1": (lambda: code_prompts(1), 38, 8),
    "code:2": (lambda: code_prompts(2), 138, 39),
}


@pytest.mark.parametrize("source", sorted(SMALL_SPACES))
def test_the_data_guide_gives_the_distinct_prompts_of_each_space(source):
    prompts, train, val = SMALL_SPACES[source]
    assert split_counts(prompts()) == {"train": train, "val": val}
    assert f"| `{source}` | {train + val} | {train} | {val} |" in DATA_GUIDE.read_text()


def test_more_rows_than_a_split_has_prompts_repeat_them_with_a_warning():
    assert len({row["prompt"] for row in arithmetic_rows(161, seed=0, max_digits=1)}) == 161  # no warning
    with pytest.warns(UserWarning, match=r"arithmetic:1 \(2 terms\): the task has 161 distinct train prompts, fewer "
                                         r"than the 200 train rows asked for: 39 rows repeat a prompt"):
        rows = arithmetic_rows(200, seed=0, max_digits=1)
    assert len(rows) == 200 and len({row["prompt"] for row in rows}) == 161
    with pytest.warns(UserWarning, match=r"code:2: the task has 39 distinct val prompts, fewer than the 48 val rows "
                                         r"asked for: 9 rows repeat a prompt"):
        code_rows(48, seed=0, split="val", level=2)


def fake_reasoning_gym(questions):
    """A stand-in for the reasoning_gym package whose task cycles through ``questions``, entry i
    of a seed s made from s + i as the real package does."""
    def create_dataset(task, size, seed):
        return ({"question": questions[(seed + i) % len(questions)], "answer": "1", "metadata": {"i": seed + i}}
                for i in range(size))
    return SimpleNamespace(create_dataset=create_dataset)


def test_reasoning_gym_rows_hold_out_validation_and_repeat_a_small_task(monkeypatch):
    questions = [f"Question {i}?" for i in range(40)]
    monkeypatch.setitem(sys.modules, "reasoning_gym", fake_reasoning_gym(questions))
    val_questions = [q for q in questions if prompt_split(q) == "val"]
    rows = {split: reasoning_gym_rows("tiny", 6, seed=3, split=split) for split in ("train", "val")}
    assert not {row["prompt"] for row in rows["train"]} & {row["prompt"] for row in rows["val"]}
    assert {prompt_split(row["prompt"]) for row in rows["val"]} == {"val"}
    assert rows["val"][0]["task"] == "tiny" and json.loads(rows["val"][0]["metadata"])
    with pytest.warns(UserWarning, match=rf"reasoning_gym:tiny: the task gave {len(val_questions)} distinct val "
                                         rf"prompts in \d+ draws, fewer than the 40 val rows asked for"):
        many = reasoning_gym_rows("tiny", 40, seed=3, split="val")
    assert sorted({row["prompt"] for row in many}) == sorted(val_questions)


def test_a_task_without_a_prompt_of_the_split_is_refused_naming_it(monkeypatch):
    train_question = next(f"Question {i}?" for i in range(100) if prompt_split(f"Question {i}?") == "train")
    monkeypatch.setitem(sys.modules, "reasoning_gym", fake_reasoning_gym([train_question]))
    with pytest.raises(ValueError, match=r"reasoning_gym:tiny: the task gave 0 distinct val prompts in 180 draws: "
                                         r"no val row to draw"):
        reasoning_gym_rows("tiny", 4, seed=0, split="val")


def write_rows(path, prompts):
    path.write_text("".join(json.dumps({"prompt": prompt, "answer": "1"}) + "\n" for prompt in prompts))
    return path


def test_validation_prompts_that_are_training_prompts_refuse_the_run(tmp_path):
    train = write_rows(tmp_path / "train.jsonl", ["What is 2 + 3?", "What is 7 - 4?", "Name a prime."])
    val = tmp_path / "val.jsonl"
    val.write_text(json.dumps({"prompt": "What is 1 + 1?"}) + "\n"
                   + json.dumps({"prompt": [{"role": "user", "content": "What is 7 - 4?"}]}) + "\n")
    data = PromptDataModule(train, val=val, batch_size=1)
    with pytest.raises(ValueError, match=re.escape(f"1 validation prompts of {val} are also training prompts of "
                                                   f"{train}, e.g. [{{'role': 'user', 'content': 'What is 7 - 4?'}}]: "
                                                   "validation would measure prompts the policy trains on")):
        data.setup("fit")


def test_the_refusal_counts_the_shared_prompts_and_shows_three(tmp_path):
    prompts = [f"Prompt {i}." for i in range(5)]
    data = PromptDataModule(write_rows(tmp_path / "train.jsonl", prompts),
                            val=write_rows(tmp_path / "val.jsonl", [*prompts, "Another."]))
    with pytest.raises(ValueError, match=r"5 validation prompts .*, e\.g\. 'Prompt 0\.', 'Prompt 1\.', 'Prompt 2\.': "
                                         r".*allow_train_val_overlap=True") as refusal:
        data.setup("fit")
    assert "Prompt 3." not in str(refusal.value)


def test_allow_train_val_overlap_warns_with_the_count_instead(tmp_path):
    train = write_rows(tmp_path / "train.jsonl", ["What is 2 + 3?", "Name a prime."])
    val = write_rows(tmp_path / "val.jsonl", ["What is 2 + 3?", "Name a prime.", "What is 1 + 1?"])
    data = PromptDataModule(train, val=val, batch_size=1, allow_train_val_overlap=True)
    with pytest.warns(UserWarning, match=r"2 validation prompts of .*val.jsonl are also training prompts of "
                                         r".*train.jsonl: validation measures them too"):
        data.setup("fit")
    assert len(data.datasets["val"]) == 3
