"""Prompt rows from files, the Hugging Face hub, or built-in generators.

A row is a dict in one of TRL's prompt formats: ``prompt`` a non-empty string (standard)
or a non-empty list of ``{"role", "content"}`` messages (conversational), or, as before,
``messages`` such a list. ``answer`` (str or number) is optional: a mixed-task dataset has
rows without a reference, and the reward functions decide what to do with them. Other
keys are kept: they reach the reward functions as columns.
"""

import json
import math
import random
from pathlib import Path
from typing import NamedTuple

from lightning_logra.data.held_out import check_split, draw_budget, rows_of_split


class InvalidJSONLine(NamedTuple):
    """Stands in for a JSONL line that does not parse, so validation can report or skip it."""

    error: str


def read_rows(path_or_name: str | Path, split: str | None = None) -> list:
    """Rows of a ``.jsonl``/``.ndjson``, ``.json`` (a list) or ``.parquet`` file, or of a
    Hugging Face ``datasets`` name, optionally with a configuration after a colon
    (``"openai/gsm8k:main"``; ``split`` defaults to ``"train"``).

    JSONL gives one entry per line, so row ``i`` is line ``i + 1`` (blank lines at the end
    of the file are ignored; an unparsable line becomes an ``InvalidJSONLine``).
    """
    path = Path(path_or_name)
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix in (".jsonl", ".ndjson"):
            return [_parse_json(line) for line in _jsonl_lines(path)]
        if suffix == ".json":
            rows = _parse_json(path.read_text(encoding="utf-8"))
            if isinstance(rows, InvalidJSONLine):
                raise ValueError(f"{path}: {rows.error}")
            if not isinstance(rows, list):
                raise ValueError(f"{path}: a .json source must hold a list of rows, got {type(rows).__name__}")
            return rows
        if suffix == ".parquet":
            return _read_parquet(path)
        raise ValueError(f"{path}: unsupported file type {suffix!r} (use .jsonl, .json or .parquet)")
    if path.suffix.lower() in (".jsonl", ".ndjson", ".json", ".parquet"):
        raise FileNotFoundError(f"data file not found: {path}")
    return _read_hub_dataset(str(path_or_name), split or "train")


def _jsonl_lines(path: Path) -> list[str]:
    """The file's lines, split on ``\n`` only: JSON strings may hold U+2028, U+0085 and other
    characters that ``str.splitlines`` would split on (``json.dumps(ensure_ascii=False)``
    writes them raw). Blank lines at the end are ignored; a line that is not UTF-8 raises,
    naming the file and the line."""
    lines = path.read_bytes().split(b"\n")
    while lines and not lines[-1].strip():
        lines.pop()
    decoded = []
    for number, line in enumerate(lines, start=1):
        try:
            decoded.append(line.decode("utf-8"))
        except UnicodeDecodeError as error:
            raise ValueError(f"{path}: line {number}: not UTF-8 (byte {line[error.start]:#04x} at column "
                             f"{error.start + 1})") from error
    return decoded


# Column names a row cannot use, and what already has them. A column of one of these names
# would be overwritten, or passed to the reward functions twice (``rl.sampling.score_rollouts``
# passes these beside the columns) and fail every step with a TypeError.
REWARD_ARGUMENT = "a keyword argument every reward function receives"
RESERVED_COLUMNS = {
    "prompt_text": "the rendered prompt the data module adds to every row",
    "completions": REWARD_ARGUMENT,
    "prompts": REWARD_ARGUMENT,
    "completion_ids": REWARD_ARGUMENT,
    "transcripts": "a keyword argument reward functions receive in multi-turn rollouts",
}


def validate_rows(rows: list, source: str, *, skip_invalid_rows: bool = False) -> tuple[list[dict], int]:
    """Check every row; returns ``(valid_rows, skipped)``.

    By default the first bad row raises ``ValueError`` naming ``source``, its location (the
    1-based line for JSONL, else the 1-based row) and the field, so ``skipped`` is 0. With
    ``skip_invalid_rows`` bad rows are dropped instead and ``skipped`` counts them. A row
    with a column of a reserved name (``RESERVED_COLUMNS``) always raises: renaming the
    column (``field_map``) is the fix, not dropping the row.
    """
    location = "line" if str(source).lower().endswith((".jsonl", ".ndjson")) else "row"
    valid = []
    for index, row in enumerate(rows, start=1):
        reserved = next((name for name in RESERVED_COLUMNS if isinstance(row, dict) and name in row), None)
        if reserved is not None:
            raise ValueError(f"{source}: {location} {index} has a column {reserved!r}, the name of "
                             f"{RESERVED_COLUMNS[reserved]}: rename the column with the data module's field_map, e.g. "
                             f"{{{reserved!r}: 'source_{reserved}'}}")
        problem = _row_problem(row)
        if problem is None:
            valid.append(row)
        elif not skip_invalid_rows:
            raise ValueError(f"{source}: {location} {index}: {problem}")
    return valid, len(rows) - len(valid)


# Arithmetic spaces up to this many problems are drawn as one shuffle of the whole space, so
# that a split's distinct prompts are all found (and counted exactly); larger ones by
# independent draws, at most ``draw_budget(n)``.
WHOLE_SPACE_LIMIT = 100_000


ARITHMETIC_SIGNS = ("+-", "+")


def arithmetic_rows(n: int, seed: int, *, split: str = "train", terms: int = 2, max_digits: int = 2,
                    signs: str = "+-") -> list[dict]:
    """``n`` deterministic problems of ``split`` (``"train"`` or ``"val"``, see ``held_out``)
    like ``What is 37 - 8 + 12?`` with integer answers; the same for a (seed, split).

    Operands have up to ``max_digits`` digits and are joined by the ``signs`` (``"+-"``, or
    ``"+"`` for sums only): the space has ``arithmetic_space_size`` problems, and a small one
    (one-digit operands: 200 problems) has few of each split, so that rows repeat past them
    (with a warning; ``arithmetic_prompts`` lists the space).
    """
    if n < 0 or terms < 2 or max_digits < 1 or signs not in ARITHMETIC_SIGNS:
        raise ValueError(f"need n >= 0, terms >= 2, max_digits >= 1, signs one of {ARITHMETIC_SIGNS}; got n={n}, "
                         f"terms={terms}, max_digits={max_digits}, signs={signs!r}")
    task = f"arithmetic:{max_digits} ({terms} terms{', sums' if signs == '+' else ''})"
    check_split(task, split)
    rng = random.Random(seed)
    space = arithmetic_space_size(terms, max_digits, signs)
    whole = space <= WHOLE_SPACE_LIMIT
    keys = rng.sample(range(space), space) if whole else (rng.randrange(space) for _ in range(draw_budget(n)))
    candidates = (_arithmetic_row(key, terms, max_digits, signs) for key in keys)
    return rows_of_split(task, split, n, candidates, exhaustive=whole)


def arithmetic_space_size(terms: int, max_digits: int, signs: str = "+-") -> int:
    """The number of distinct problems: every operand from 0 to 10**max_digits - 1, every sign of ``signs``."""
    return 10 ** (max_digits * terms) * len(signs) ** (terms - 1)


def arithmetic_prompts(terms: int, max_digits: int, signs: str = "+-") -> list[str]:
    """Every prompt of the space (for counting a small space's prompts per split)."""
    space = arithmetic_space_size(terms, max_digits, signs)
    return [_arithmetic_row(key, terms, max_digits, signs)["prompt"] for key in range(space)]


def _arithmetic_row(key: int, terms: int, max_digits: int, signs: str) -> dict:
    """Problem number ``key`` of the space: its operands and signs are the key's digits in
    base ``10**max_digits`` and ``len(signs)``."""
    numbers = []
    for _ in range(terms):
        key, number = divmod(key, 10**max_digits)
        numbers.append(number)
    chosen = []
    for _ in range(terms - 1):
        key, sign = divmod(key, len(signs))
        chosen.append(signs[sign])
    signs = chosen
    expression = str(numbers[0]) + "".join(f" {s} {x}" for s, x in zip(signs, numbers[1:]))
    total = numbers[0] + sum(x if s == "+" else -x for s, x in zip(signs, numbers[1:]))
    return {"prompt": f"What is {expression}?", "answer": str(total)}


# Starts of reasoning-gym's seed ranges: below 2**31, so that start + index stays within the
# 32-bit seeds some generators pass on to numpy.
REASONING_GYM_STARTS = 2**31


def reasoning_gym_rows(task: str, n: int, seed: int, *, split: str = "train") -> list[dict]:
    """``n`` problems of ``split`` (``"train"`` or ``"val"``, see ``held_out``) of a
    reasoning-gym task (e.g. ``basic_arithmetic``, ``chain_sum``), each with its ``task``
    and its entry's ``metadata`` (JSON), which the task's scorer may read
    (``rewards.reasoning_gym.reasoning_gym_reward``).

    reasoning-gym makes entry ``i`` of ``create_dataset(task, seed=s)`` from ``s + i``, so
    datasets of nearby seeds share entries: the candidates are the entries from a start
    drawn with ``seed`` (one of ``2**31``), at most ``draw_budget(n)`` of them, and those of
    ``split`` are kept. A task with few distinct problems repeats them, with a warning.
    """
    name = f"reasoning_gym:{task}"
    check_split(name, split)
    if n < 0:
        raise ValueError(f"{name}: need n >= 0, got n={n}")
    try:
        import reasoning_gym
    except ImportError as error:
        raise ImportError("reasoning_gym sources need `pip install reasoning-gym`") from error
    start = random.Random(seed).randrange(REASONING_GYM_STARTS)
    entries = reasoning_gym.create_dataset(task, size=draw_budget(n), seed=start)
    candidates = ({"prompt": entry["question"], "answer": entry["answer"], "task": task,
                   "metadata": json.dumps(entry["metadata"], default=str)} for entry in entries)
    return rows_of_split(name, split, n, candidates, exhaustive=False)


def _parse_json(text: str):
    """The value ``text`` holds, or an ``InvalidJSONLine`` saying why json cannot read it:
    malformed, an integer past Python's 4300-digit conversion limit (``ValueError``), or
    nested deeper than the recursion limit (``RecursionError``)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        return InvalidJSONLine(f"invalid JSON ({error.msg})")
    except RecursionError:
        return InvalidJSONLine("invalid JSON (nested too deeply to read)")
    except ValueError as error:
        return InvalidJSONLine(f"invalid JSON ({error})")


def _read_parquet(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet
    except ImportError as error:
        raise ImportError(f"{path}: reading Parquet needs `pip install pyarrow`") from error
    return pyarrow.parquet.read_table(path).to_pylist()


def _read_hub_dataset(name: str, split: str) -> list[dict]:
    try:
        import datasets
    except ImportError as error:
        raise ImportError(
            f"{name!r} is not a file; loading it as a Hugging Face dataset needs `pip install datasets`"
        ) from error
    name, _, configuration = name.partition(":")
    return list(datasets.load_dataset(name, configuration or None, split=split))


def _row_problem(row) -> str | None:
    if isinstance(row, InvalidJSONLine):
        return row.error
    if not isinstance(row, dict):
        return f"expected an object, got {type(row).__name__}"
    return _prompt_problem(row) or _answer_problem(row.get("answer"))


def _prompt_problem(row: dict) -> str | None:
    prompt = row.get("prompt")
    if isinstance(prompt, list):
        return _messages_problem(prompt, "prompt")
    if prompt is not None:
        if not isinstance(prompt, str) or not prompt.strip():
            return "field 'prompt' must be a non-empty string or a list of messages"
        return None
    if row.get("messages") is not None:
        return _messages_problem(row["messages"], "messages")
    return "needs field 'prompt' or 'messages'"


def _answer_problem(answer) -> str | None:
    if answer is None:
        return None  # optional: the reward functions decide
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        return f"field 'answer' must be a string or number, got {type(answer).__name__}"
    if isinstance(answer, float) and not math.isfinite(answer):
        return f"field 'answer' is {answer}"
    return None


def _messages_problem(messages, field: str) -> str | None:
    if not isinstance(messages, list) or not messages:
        return f"field '{field}' must be a non-empty list"
    for position, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return f"field '{field}[{position}]' needs a string 'role'"
        if not isinstance(message.get("content"), str):
            return f"field '{field}[{position}]' needs a string 'content'"
    return None
