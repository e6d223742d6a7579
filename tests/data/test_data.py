import importlib.util
import json
import re
from types import SimpleNamespace

import pyarrow
import pyarrow.parquet
import pytest

from lightning_logra.data import (
    PromptDataModule,
    collate_prompts,
    ResumableLoader,
    ResumableSampler,
    arithmetic_rows,
    read_rows,
    reasoning_gym_rows,
    validate_rows,
)
from tests.helpers.data import fit_prompts
from tests.helpers.models import byte_tokenizer

GOOD_ROWS = [
    {"prompt": "What is 2 + 3?", "answer": "5"},
    {"messages": [{"role": "user", "content": "What is 7 - 4?"}], "answer": 3},
]


def write_jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_read_rows_jsonl_keeps_one_entry_per_line(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [json.dumps(r) for r in GOOD_ROWS] + ["{broken", ""])
    rows = read_rows(path)
    assert rows[:2] == GOOD_ROWS
    with pytest.raises(ValueError, match=r"rows.jsonl: line 3: invalid JSON"):
        validate_rows(rows, str(path))


def test_read_rows_jsonl_keeps_line_separators_inside_strings_in_their_row(tmp_path):
    rows = [{"prompt": "a\u2028b\u0085c\x1cd", "answer": "1"}, {"prompt": "e", "answer": "2"}]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(row, ensure_ascii=False) for row in rows) + "\n\n", encoding="utf-8")
    assert "\u2028" in path.read_text(encoding="utf-8")  # written raw, as ensure_ascii=False does
    assert read_rows(path) == rows


def test_read_rows_jsonl_names_the_file_and_line_of_a_byte_that_is_not_utf8(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(json.dumps(GOOD_ROWS[0]).encode() + b"\n" + b'{"prompt": "\xff", "answer": "1"}\n')
    with pytest.raises(ValueError, match=r"rows.jsonl: line 2: not UTF-8 \(byte 0xff at column 13\)"):
        read_rows(path)


def test_read_rows_json_and_parquet(tmp_path):
    (tmp_path / "rows.json").write_text(json.dumps(GOOD_ROWS))
    assert read_rows(tmp_path / "rows.json") == GOOD_ROWS
    table = pyarrow.table({"prompt": ["What is 1 + 1?", ""], "answer": ["2", "0"]})
    pyarrow.parquet.write_table(table, tmp_path / "rows.parquet")
    rows = read_rows(str(tmp_path / "rows.parquet"))
    assert rows == [{"prompt": "What is 1 + 1?", "answer": "2"}, {"prompt": "", "answer": "0"}]
    with pytest.raises(ValueError, match=r"rows.parquet: row 2: field 'prompt' must be a non-empty string"):
        validate_rows(rows, str(tmp_path / "rows.parquet"))


def test_read_rows_reports_bad_paths(tmp_path):
    (tmp_path / "rows.csv").write_text("prompt,answer\n")
    with pytest.raises(ValueError, match="unsupported file type '.csv'"):
        read_rows(tmp_path / "rows.csv")
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        read_rows(tmp_path / "missing.jsonl")


@pytest.mark.skipif(importlib.util.find_spec("datasets") is not None, reason="datasets is installed")
def test_read_rows_hub_name_without_datasets_says_what_to_install():
    with pytest.raises(ImportError, match="pip install datasets"):
        read_rows("openai/gsm8k", split="train")


BAD_ROWS = [
    ({"answer": "1"}, "needs field 'prompt' or 'messages'"),
    ({"prompt": [], "answer": "1"}, "field 'prompt' must be a non-empty list"),
    ({"prompt": "   ", "answer": "1"}, "field 'prompt' must be a non-empty string"),
    ({"prompt": 12, "answer": "1"}, "field 'prompt' must be a non-empty string or a list of messages"),
    ({"prompt": [{"role": "user"}]}, r"field 'prompt\[0\]' needs a string 'content'"),
    ({"prompt": "Hi", "answer": [1]}, "field 'answer' must be a string or number, got list"),
    ({"prompt": "Hi", "answer": True}, "field 'answer' must be a string or number, got bool"),
    ({"messages": [], "answer": "1"}, "field 'messages' must be a non-empty list"),
    ({"messages": [{"content": "Hi"}], "answer": "1"}, r"field 'messages\[0\]' needs a string 'role'"),
    (
        {"messages": [{"role": "user", "content": None}], "answer": "1"},
        r"field 'messages\[0\]' needs a string 'content'",
    ),
    (["not", "an", "object"], "expected an object, got list"),
]


@pytest.mark.parametrize(("row", "message"), BAD_ROWS)
def test_validate_rows_names_the_line_and_field(tmp_path, row, message):
    path = write_jsonl(tmp_path / "train.jsonl", [json.dumps(GOOD_ROWS[0]), json.dumps(row)])
    with pytest.raises(ValueError, match=rf"train.jsonl: line 2: {message}"):
        validate_rows(read_rows(path), str(path))


def test_validate_rows_can_skip_and_count():
    rows = [GOOD_ROWS[0], BAD_ROWS[0][0], GOOD_ROWS[1], BAD_ROWS[4][0]]
    valid, skipped = validate_rows(rows, "memory", skip_invalid_rows=True)
    assert valid == GOOD_ROWS and skipped == 2
    assert validate_rows(GOOD_ROWS, "memory") == (GOOD_ROWS, 0)  # same shape without skipping


def test_arithmetic_rows_are_deterministic_and_correct():
    rows = arithmetic_rows(50, seed=3, terms=3, max_digits=2)
    assert rows == arithmetic_rows(50, seed=3, terms=3, max_digits=2)
    assert rows != arithmetic_rows(50, seed=4, terms=3, max_digits=2)
    for row in rows:
        expression = row["prompt"].removeprefix("What is ").removesuffix("?")
        assert len(expression.split()) == 5
        assert all(len(term) <= 2 for term in expression.split()[::2])
        assert int(row["answer"]) == eval(expression)  # noqa: S307 - digits and +/- only
    assert {"+", "-"} <= {symbol for row in rows for symbol in row["prompt"].split()[3::2]}


def test_reasoning_gym_rows_are_valid_and_the_same_for_a_seed():
    for split in ("train", "val"):
        rows = reasoning_gym_rows("basic_arithmetic", 3, seed=1, split=split)
        assert rows == reasoning_gym_rows("basic_arithmetic", 3, seed=1, split=split)
        assert len(rows) == 3
        assert validate_rows(rows, "reasoning_gym:basic_arithmetic") == (rows, 0)


def test_datamodule_renders_chat_prompts_and_batches(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [json.dumps(r) for r in GOOD_ROWS])
    data = PromptDataModule(path, tokenizer=byte_tokenizer(tmp_path), batch_size=2, system_prompt="Be brief.")
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    assert sorted(batch["prompt_text"]) == [
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 7 - 4?<|im_end|>\n<|im_start|>assistant\n",
    ]
    assert sorted(batch["answer"]) == ["3", "5"]


def test_datamodule_without_chat_template_uses_the_plain_prompt():
    data = PromptDataModule("arithmetic", val="arithmetic", batch_size=4, train_size=8, val_size=4, system_prompt="Sys")
    data.setup("fit")
    val = next(iter(data.val_dataloader()))
    expected = arithmetic_rows(4, seed=0, split="val")  # in order
    assert val["prompt_text"] == [f"Sys\n\n{row['prompt']}" for row in expected]
    assert val["answer"] == [row["answer"] for row in expected]


def test_val_batch_size_sets_the_validation_batches_only():
    data = PromptDataModule("arithmetic", val="arithmetic", batch_size=2, train_size=8, val_size=10, val_batch_size=4)
    data.setup("fit")
    assert [len(batch["prompt"]) for batch in data.val_dataloader()] == [4, 4, 2]  # in order, the last one short
    assert [len(batch["prompt"]) for batch in data.train_dataloader()] == [2, 2, 2, 2]
    default = PromptDataModule("arithmetic", val="arithmetic", batch_size=2, train_size=8, val_size=4)
    default.setup("fit")
    assert [len(batch["prompt"]) for batch in default.val_dataloader()] == [2, 2]
    rows = [row for batch in data.val_dataloader() for row in batch["prompt"]]
    assert rows == [row["prompt"] for row in arithmetic_rows(10, seed=0, split="val")]


def test_datamodule_skips_invalid_and_long_rows(tmp_path):
    too_long = {"prompt": "x" * 40, "answer": "1"}
    lines = [json.dumps(GOOD_ROWS[0]), "{broken", json.dumps(too_long), json.dumps({"prompt": "Hi", "answer": [1]})]
    path = write_jsonl(tmp_path / "train.jsonl", lines)
    tokenizer = byte_tokenizer(tmp_path)
    strict = PromptDataModule(path, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="train.jsonl: line 2: invalid JSON"):
        strict.setup("fit")
    # The rendered first prompt is 33 byte tokens (14 bytes wrapped in 19 of ChatML); the other 59.
    data = PromptDataModule(path, tokenizer=tokenizer, skip_invalid_rows=True, max_prompt_tokens=33)
    data.setup("fit")
    assert data.skipped == {"train": {"invalid": 2, "too_long": 1}}
    assert [row["answer"] for row in data.datasets["train"].columns] == ["5"]
    assert len(tokenizer(data.datasets["train"].prompt_texts[0])["input_ids"]) == 33


def test_datamodule_order_is_seeded_and_changes_per_epoch():
    def epoch_prompts(seed, epoch):
        data = PromptDataModule("arithmetic", batch_size=4, train_size=12, seed=seed)
        data.setup("fit")
        loader = data.train_dataloader()
        loader.sampler.set_epoch(epoch)
        return [prompt for batch in loader for prompt in batch["prompt_text"]]

    first = epoch_prompts(seed=0, epoch=0)
    assert first == epoch_prompts(seed=0, epoch=0)
    assert sorted(first) == sorted(row["prompt"] for row in arithmetic_rows(12, seed=0))
    assert first != epoch_prompts(seed=0, epoch=1)
    assert sorted(first) == sorted(epoch_prompts(seed=0, epoch=1))


def test_resumable_sampler_splits_ranks_and_starts_part_way():
    dataset = list(range(10))
    shares = [list(ResumableSampler(dataset, num_replicas=2, rank=r, seed=7)) for r in (0, 1)]
    assert sorted(shares[0] + shares[1]) == dataset
    sampler = ResumableSampler(dataset, num_replicas=2, rank=1, seed=7)
    sampler.consumed = 4  # rows of both ranks: 2 each
    assert list(sampler) == shares[1][2:]
    sampler.set_epoch(1)
    assert sampler.consumed == 0


def test_resumable_sampler_continues_an_epoch_on_another_number_of_ranks():
    dataset = list(range(12))
    two_ranks = [list(ResumableSampler(dataset, num_replicas=2, rank=rank, seed=7)) for rank in (0, 1)]
    one_rank = ResumableSampler(dataset, num_replicas=1, rank=0, seed=7)
    one_rank.consumed = 8  # 2 batches of 2 on each of 2 ranks
    assert sorted(two_ranks[0][:4] + two_ranks[1][:4] + list(one_rank)) == dataset
    whole_epoch = list(ResumableSampler(dataset, num_replicas=1, rank=0, seed=7))
    rest = []
    for rank in (0, 1):
        sampler = ResumableSampler(dataset, num_replicas=2, rank=rank, seed=7)
        sampler.consumed = 6  # 3 batches of 2 on one rank
        rest += list(sampler)
    assert sorted(whole_epoch[:6] + rest) == dataset


def stub_trainer(processed: int, epoch: int = 0):
    """What ResumableLoader reads of a Trainer: the epoch and its batch progress."""
    progress = SimpleNamespace(ready=processed, started=processed, processed=processed, completed=processed - 1)
    epoch_loop = SimpleNamespace(batch_progress=SimpleNamespace(current=progress))
    return SimpleNamespace(current_epoch=epoch, fit_loop=SimpleNamespace(epoch_loop=epoch_loop))


def one_rank_loader(trainer, rows=16):
    data = PromptDataModule("arithmetic", batch_size=2, train_size=rows)
    data.setup("fit")
    sampler = ResumableSampler(data.datasets["train"], num_replicas=1, rank=0, seed=0)
    return ResumableLoader(data.datasets["train"], trainer=trainer, batch_size=2, sampler=sampler, drop_last=True)


def test_loader_state_counts_the_rows_of_all_ranks_across_a_change_of_rank_count():
    trainer = stub_trainer(processed=2)
    loader = one_rank_loader(trainer)
    loader.load_state_dict({"epoch": 0, "rows": 8, "batches": 2})  # 2 batches of 2 on each of 2 ranks
    # 8 rows left make 4 of this rank's 8 batches: Lightning counts the other 4 as done.
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    assert (progress.ready, progress.started, progress.processed, progress.completed) == (4, 4, 4, 3)
    assert len(list(loader)) == 4
    progress.processed = 5  # one batch of 2 rows trained since the resume
    assert loader.state_dict() == {"epoch": 0, "rows": 10, "batches": 5}
    trainer.current_epoch, progress.processed = 1, 1  # a new epoch counts from its start
    assert loader.state_dict() == {"epoch": 1, "rows": 2, "batches": 1}


def test_loader_reads_a_per_rank_state_of_older_versions():
    loader = one_rank_loader(stub_trainer(processed=3))
    loader.load_state_dict({"epoch": 0, "start": 6})
    assert loader.sampler.consumed == 6 and len(list(loader)) == 5


def test_train_batches_are_all_full_the_rows_left_over_are_dropped():
    data = PromptDataModule("arithmetic", batch_size=2, train_size=5)
    data.setup("fit")
    loader = data.train_dataloader()
    assert [len(batch["prompt_text"]) for batch in loader] == [2, 2] and len(loader) == 2


def test_a_train_set_smaller_than_one_batch_is_refused():
    data = PromptDataModule("arithmetic", batch_size=4, train_size=3)
    data.setup("fit")
    with pytest.raises(ValueError, match=r"arithmetic: 3 usable train rows make 3 per rank on 1 rank\(s\), fewer "
                                         r"than batch_size = 4"):
        data.train_dataloader()


def test_fit_resumed_mid_epoch_continues_the_same_order(tmp_path):
    # 9 rows in batches of 2: 4 steps per epoch (the ninth row dropped). Checkpoints at steps 3 (mid epoch 0)
    # and 6 (mid epoch 1).
    full = fit_prompts(tmp_path / "full", max_steps=8)
    assert fit_prompts(tmp_path / "a", 8, ckpt_path=tmp_path / "full" / "epoch=0-step=3.ckpt") == full[3:]
    assert fit_prompts(tmp_path / "b", 8, ckpt_path=tmp_path / "full" / "epoch=1-step=6.ckpt") == full[6:]


def test_field_map_renames_columns_before_validation(tmp_path):
    import json

    from lightning_logra.data import PromptDataModule

    path = tmp_path / "gsm.jsonl"
    path.write_text(json.dumps({"question": "What is 2 + 2?", "answer": "2 + 2 = 4\n#### 4"}) + "\n")
    data = PromptDataModule(train=str(path), field_map={"question": "prompt"}, batch_size=1)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    assert batch["prompt_text"] == ["What is 2 + 2?"] and batch["answer"] == ["2 + 2 = 4\n#### 4"]


def test_instruction_and_arithmetic_digits():
    from lightning_logra.data import PromptDataModule

    data = PromptDataModule(train="arithmetic:1", instruction=" Answer with just the number.", batch_size=4, train_size=4)
    data.setup("fit")
    prompts = data.datasets["train"].prompt_texts
    assert all(p.endswith("? Answer with just the number.") for p in prompts)
    assert all(len(token) == 1 for p in prompts for token in p.split("?")[0].split()[2::2])
    for bad in ("arithmetic:x", "arithmetic:1x", "arithmetic:1x1", "arithmetic:0", "arithmetic:two"):
        with pytest.raises(ValueError, match="arithmetic:<max_digits>"):
            PromptDataModule(train=bad).setup("fit")
    # arithmetic:<max_digits>x<terms>: three one-digit operands.
    data = PromptDataModule(train="arithmetic:1x3", batch_size=4, train_size=8)
    data.setup("fit")
    expressions = [p.split("?")[0].removeprefix("What is ").split() for p in data.datasets["train"].prompt_texts]
    assert all(len(e) == 5 and all(len(e[i]) == 1 for i in (0, 2, 4)) for e in expressions)
    # A trailing +: sums only, with answers equal to the sums.
    data = PromptDataModule(train="arithmetic:2+", val="arithmetic:2+", batch_size=4, train_size=40, val_size=40)
    data.setup("fit")
    for split in ("train", "val"):
        for row in data.datasets[split].columns:
            left, sign, right = row["prompt"].removeprefix("What is ").removesuffix("?").split()
            assert sign == "+" and int(row["answer"]) == int(left) + int(right) and max(len(left), len(right)) <= 2
    for bad in ("arithmetic:2-", "arithmetic:+2", "arithmetic:2++"):
        with pytest.raises(ValueError, match="followed by \\+ for sums only"):
            PromptDataModule(train=bad).setup("fit")


CHAT_PROMPT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]


def first_val_batch(tmp_path, rows, **options):
    """The rows as one batch of the (unshuffled) validation loader."""
    train = write_jsonl(tmp_path / "train.jsonl", [json.dumps({"prompt": "A training prompt."})])
    path = write_jsonl(tmp_path / "rows.jsonl", [json.dumps(row) for row in rows])
    data = PromptDataModule(train, val=path, tokenizer=byte_tokenizer(tmp_path), batch_size=len(rows), **options)
    data.setup("fit")
    return next(iter(data.val_dataloader()))


def test_conversational_prompt_renders_with_the_chat_template(tmp_path):
    batch = first_val_batch(tmp_path, [{"prompt": CHAT_PROMPT, "answer": "5"}], instruction=" Just the number.")
    assert batch["prompt_text"] == [
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 3? Just the number.<|im_end|>\n<|im_start|>assistant\n"
    ]


def test_conversational_prompt_passes_its_messages_through_unchanged(tmp_path):
    batch = first_val_batch(tmp_path, [{"prompt": CHAT_PROMPT, "answer": "5"}], instruction=" Just the number.")
    assert batch["prompt"] == [CHAT_PROMPT]


def test_batch_prompt_is_the_string_or_the_messages_of_each_row(tmp_path):
    batch = first_val_batch(tmp_path, GOOD_ROWS)
    assert batch["prompt"] == ["What is 2 + 3?", [{"role": "user", "content": "What is 7 - 4?"}]]


def test_extra_columns_pass_through_collate(tmp_path):
    rows = [{"prompt": "Hi", "answer": 1, "task": "math", "solution": "1"}, {"prompt": "Yo", "task": "chat"}]
    batch = first_val_batch(tmp_path, rows)
    assert batch == {
        "prompt_text": [
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
            "<|im_start|>user\nYo<|im_end|>\n<|im_start|>assistant\n",
        ],
        "prompt": ["Hi", "Yo"],
        "answer": ["1", None],
        "task": ["math", "chat"],
        "solution": ["1", None],
    }


def test_missing_answer_is_allowed():
    rows = [{"prompt": "Hi"}, {"prompt": "Yo", "answer": None}]
    assert validate_rows(rows, "memory") == (rows, 0)


def test_collate_prompts_always_has_prompt_text_prompt_and_answer():
    batch = collate_prompts([{"task": "a"}])
    assert batch == {"prompt_text": [None], "prompt": [None], "answer": [None], "task": ["a"]}


def test_reasoning_gym_task_column_reaches_the_batch():
    data = PromptDataModule("arithmetic", val="reasoning_gym:basic_arithmetic", batch_size=2, val_size=2)
    data.setup("fit")
    assert next(iter(data.val_dataloader()))["task"] == ["basic_arithmetic", "basic_arithmetic"]


def test_instruction_is_appended_to_the_last_user_message_of_a_messages_row(tmp_path):
    chat = [*CHAT_PROMPT, {"role": "assistant", "content": "5"}, {"role": "user", "content": "And 3 + 4?"}]
    batch = first_val_batch(tmp_path, [{"messages": chat}], instruction=" Just the number.")
    last_turn = "<|im_start|>user\nAnd 3 + 4? Just the number.<|im_end|>\n<|im_start|>assistant\n"
    assert batch["prompt_text"][0].endswith(last_turn)
    assert batch["prompt"] == [chat]


def test_instruction_needs_a_user_message_in_a_conversational_prompt(tmp_path):
    rows = [{"prompt": [{"role": "system", "content": "Only a system turn."}]}]
    with pytest.raises(ValueError, match="a prompt has no 'user' message"):
        first_val_batch(tmp_path, rows, instruction=" Be brief.")


@pytest.mark.parametrize(("argument", "value", "allowed"), [
    ("batch_size", 0, "an integer >= 1"),
    ("batch_size", True, "an integer >= 1"),
    ("num_workers", -1, "an integer >= 0"),
    ("train_size", 2.5, "an integer >= 1"),
    ("seed", -1, "an integer >= 0"),
    ("max_prompt_tokens", 0, "an integer >= 1 or None"),
    ("skip_invalid_rows", "yes", "true or false"),
    ("val_batch_size", 0, "an integer >= 1 or None"),
    ("allow_train_val_overlap", "yes", "true or false"),
])
def test_datamodule_arguments_are_checked_like_config_fields(argument, value, allowed):
    with pytest.raises(ValueError, match=rf"PromptDataModule\.{argument} = {re.escape(repr(value))} is invalid: "
                                         rf"must be {re.escape(allowed)}"):
        PromptDataModule(train="arithmetic", tokenizer="unused", **{argument: value})


def test_max_prompt_tokens_needs_a_tokenizer():
    with pytest.raises(ValueError, match=r"PromptDataModule\.max_prompt_tokens = 8 is invalid: must be None without "
                                         r"a tokenizer"):
        PromptDataModule(train="arithmetic", max_prompt_tokens=8)


HUGE_INTEGER_LINE = '{"prompt": "Hi", "answer": ' + "9" * 5000 + "}"  # past Python's 4300-digit limit
DEEP_NESTING_LINE = '{"prompt": "Hi", "extra": ' + "[" * 100_000 + "]" * 100_000 + "}"  # past the recursion limit


@pytest.mark.parametrize(("line", "reason"), [(HUGE_INTEGER_LINE, "integer string conversion"),
                                              (DEEP_NESTING_LINE, "nested too deeply")],
                         ids=["huge_integer", "deep_nesting"])
def test_a_jsonl_line_json_cannot_read_is_named_or_skipped(tmp_path, line, reason):
    path = write_jsonl(tmp_path / "train.jsonl", [json.dumps(GOOD_ROWS[0]), line, json.dumps(GOOD_ROWS[1])])
    with pytest.raises(ValueError, match=rf"train.jsonl: line 2: invalid JSON \(.*{reason}"):
        PromptDataModule(path).setup("fit")
    data = PromptDataModule(path, skip_invalid_rows=True)
    data.setup("fit")
    assert data.skipped["train"]["invalid"] == 1 and len(data.datasets["train"]) == 2


def test_a_json_file_json_cannot_read_names_the_file(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text("[" + HUGE_INTEGER_LINE + "]")
    with pytest.raises(ValueError, match=r"rows.json: invalid JSON \(.*integer string conversion"):
        read_rows(path)


@pytest.mark.parametrize("column", ["prompt_text", "completions", "prompts", "completion_ids", "transcripts"])
def test_a_column_with_a_name_already_in_use_is_refused_naming_field_map(tmp_path, column):
    path = write_jsonl(tmp_path / "train.jsonl", [json.dumps(GOOD_ROWS[0]),
                                                  json.dumps({**GOOD_ROWS[0], column: "mine"})])
    with pytest.raises(ValueError, match=rf"train.jsonl: line 2 has a column '{column}', the name of .*field_map"):
        PromptDataModule(path, skip_invalid_rows=True).setup("fit")
    renamed = PromptDataModule(path, field_map={column: "source_" + column}, batch_size=2)
    renamed.setup("fit")
    assert sorted(map(str, next(iter(renamed.train_dataloader()))["source_" + column])) == ["None", "mine"]


@pytest.mark.parametrize("seed", [2**63, 2**64])
def test_a_seed_past_64_bits_is_refused_at_construction(seed):
    with pytest.raises(ValueError, match=rf"PromptDataModule\.seed = {seed} is invalid: must be an integer >= 0 and "
                                         r"<= 2\*\*63 - 1"):
        PromptDataModule(train="arithmetic", seed=seed)


def test_the_largest_seed_shuffles_every_epoch():
    data = PromptDataModule("arithmetic", batch_size=4, train_size=8, seed=2**63 - 1)
    data.setup("fit")
    loader = data.train_dataloader()
    for epoch in (0, 1, 2):  # the shuffle is seeded with seed + epoch
        loader.sampler.set_epoch(epoch)
        assert sum(len(batch["prompt_text"]) for batch in loader) == 8
