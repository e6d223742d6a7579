"""Train and validation prompts of the built-in tasks, held out by construction.

Every prompt text belongs to one split, decided by a stable hash of the text (sha256, not
Python's per-process ``hash``): one prompt in ``VAL_SHARE`` is a validation prompt. The
split depends on nothing else (no seed, task or machine), so no validation prompt is a
training prompt of any seed. A built-in generator draws candidates with its seed and keeps
those of the split it draws for (``rows_of_split``); the seed decides which of the split's
prompts are drawn, and in which order.
"""

from __future__ import annotations

import hashlib
import warnings
from collections import Counter
from collections.abc import Iterable

SPLITS = ("train", "val")
VAL_SHARE = 5  # one prompt in VAL_SHARE is a validation prompt


def prompt_split(prompt: str) -> str:
    """``"val"`` or ``"train"``: the split ``prompt`` belongs to, for every seed."""
    bucket = int.from_bytes(hashlib.sha256(prompt.encode("utf-8")).digest()[:8], "big") % VAL_SHARE
    return "val" if bucket == 0 else "train"


def check_split(task: str, split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"{task}: split must be 'train' or 'val', got {split!r}")


def split_counts(prompts: Iterable[str]) -> dict[str, int]:
    """How many distinct prompts of ``prompts`` each split has."""
    counts = Counter(prompt_split(prompt) for prompt in set(prompts))
    return {split: counts[split] for split in SPLITS}


def rows_of_split(task: str, split: str, n: int, candidates: Iterable[dict], *, exhaustive: bool) -> list[dict]:
    """``n`` rows of ``split``: the candidates (rows the task drew with its seed, in order)
    whose prompt is of ``split`` and not already taken, so that no prompt repeats while the
    split has new ones.

    ``exhaustive`` says the candidates hold every prompt of the task (a shuffle of its whole
    space); otherwise they are a bounded number of draws. When they run out before ``n``
    rows, the rows found repeat, in order, up to ``n`` with a warning counting the repeated
    rows; when they hold no prompt of ``split`` at all, ``ValueError``.
    """
    if n == 0:
        return []
    rows, taken, drawn = [], set(), 0
    for row in candidates:
        drawn += 1
        if row["prompt"] not in taken and prompt_split(row["prompt"]) == split:
            taken.add(row["prompt"])
            rows.append(row)
            if len(rows) == n:
                return rows
    found = (f"has {len(rows)} distinct {split} prompts" if exhaustive
             else f"gave {len(rows)} distinct {split} prompts in {drawn} draws")
    if not rows:
        raise ValueError(f"{task}: the task {found}: no {split} row to draw")
    warnings.warn(f"{task}: the task {found}, fewer than the {n} {split} rows asked for: {n - len(rows)} rows "
                  "repeat a prompt", stacklevel=3)
    return [rows[i % len(rows)] for i in range(n)]


def draw_budget(n: int) -> int:
    """How many candidates a task without a whole-space shuffle draws for ``n`` rows before it
    gives up: four times what the validation split needs on average."""
    return 4 * VAL_SHARE * n + 100
