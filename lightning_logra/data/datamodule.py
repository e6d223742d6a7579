"""LightningDataModule of RL prompts: rows -> chat-formatted prompt texts plus the row's columns."""

import itertools
import json
import math
import re
from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_logra.core.validation import FieldChecks
from lightning_logra.data.code_tasks import code_rows
from lightning_logra.data.sources import arithmetic_rows, read_rows, reasoning_gym_rows, validate_rows


class PromptDataModule(LightningDataModule):
    """Batches of ``batch_size`` prompts per step on each rank, as a dict of lists (see
    ``collate_prompts``): ``prompt_text`` (the rendered chat text to generate from),
    ``prompt`` (the row's original prompt: its string, or its messages list), ``answer``
    (``str``, or None for a row without one) and every other column of the rows, which the
    reward functions receive. Tokenising for generation is the rollout engine's job.

    Rows are in TRL's formats: ``prompt`` a string or a list of ``{"role", "content"}``
    messages, or ``messages`` such a list (see ``validate_rows``).

    Sources (``train``, ``val``): a ``.jsonl``/``.json``/``.parquet`` file, a Hugging Face
    dataset name (``train_split``/``val_split``), ``"arithmetic"`` (synthetic, see
    ``arithmetic_rows``), ``"code"`` (see ``code_rows``) or ``"reasoning_gym:<task>"``; the
    built-in ones draw ``train_size``/``val_size`` rows with ``seed``, the train rows from
    their training prompts and the validation rows from their validation prompts: every
    prompt text belongs to one of the two by a hash of the text, whatever the seed (see
    ``lightning_logra.data.held_out``), so no validation prompt is ever a training prompt.
    Their small spaces (``arithmetic:1``, ``code:1``, ``code:2``) have fewer distinct prompts
    than large sizes ask for: their rows repeat, with a warning.

    Held out: at setup, the prompts of the validation rows are compared with those of the
    train rows, for every kind of source, as the rows give them (with columns renamed, before
    the instruction, the system prompt or the chat template is added; a string prompt and the
    same text as one user message count as equal). Shared prompts refuse the run with
    ``ValueError`` (their count and up to 3 of them), or, with ``allow_train_val_overlap``, warn.

    Prompts are rendered with the tokenizer's chat template (``add_generation_prompt=True``)
    when it has one, after ``system_prompt``; otherwise the message contents are joined.
    Prompts longer than ``max_prompt_tokens`` are dropped; counts of dropped rows are in
    ``skipped`` (e.g. ``skipped["train"]["invalid"]``).

    ``instruction`` is appended to every prompt (e.g. " Answer with just the number."): to a
    string prompt, or to the content of a conversational one's last user message.
    ``conversational=True`` hands string prompts to the reward functions as one user message
    (TRL's conversational format), so that functions written for chat datasets (most of
    ``trl.rewards``) receive their completions as messages; the rendered text is the same.
    ``"arithmetic:<max_digits>"`` sets the operands' digits of the built-in source (2 by default),
    ``"arithmetic:<max_digits>x<terms>"`` also how many operands (2 by default); a trailing
    ``+`` (``"arithmetic:2+"``) draws sums only.
    ``"code:<level>"`` (1 by default, or 2) draws small Python functions to write, with
    hidden tests in a ``tests`` column for ``code_execution_reward`` (see ``code_rows``).

    ``field_map`` renames a dataset's columns to ``prompt``/``messages``/``answer`` before
    validation, e.g. ``{"question": "prompt"}`` for GSM8K (whose ``answer`` ends in ``#### N``,
    which the math reward reduces to N).

    Training order is a seeded shuffle per epoch, split across ranks (a
    ``DistributedSampler``). Every train batch is full: the rows left over at the end of an
    epoch's share, fewer than ``batch_size``, are dropped for that epoch (``drop_last``; a
    later epoch's shuffle trains them), so a step always has ``batch_size`` prompts for
    ``GRPOModule``'s ``batching.mini_batches`` to divide. A train set smaller than one batch
    on each rank is refused.
    The train loader's position, the count of the epoch's rows consumed by all ranks
    together, is saved in Trainer checkpoints, so a fit resumed mid-epoch, on as many ranks
    or not, continues that epoch's order where the checkpoint left it.

    Args:
        tokenizer: the tokenizer (or its hub id, folder or built-in name, loaded at setup)
            whose chat template renders prompts and counts ``max_prompt_tokens``; None joins
            the message contents.
        num_workers: DataLoader worker processes.
        skip_invalid_rows: drop rows that fail validation (counted in ``skipped``) instead of
            raising on the first one.
        seed: the training order's shuffle seed (and the built-in sources' draw), from 0 to
            2**63 - 1.
        val_batch_size: prompts per validation batch on each rank (default ``batch_size``).
            Validation only generates, so a larger batch costs memory for its rollouts, not
            for gradients, and takes fewer, wider generation calls. Each batch's samples are
            seeded by its index, so changing it changes which samples are drawn.
        allow_train_val_overlap: validate even when validation prompts are also training
            prompts (e.g. to watch the training prompts themselves), with a warning counting
            them, instead of refusing the run.
    """

    def __init__(
        self,
        train: str | Path,
        val: str | Path | None = None,
        tokenizer=None,
        batch_size: int = 8,
        num_workers: int = 0,
        system_prompt: str | None = None,
        skip_invalid_rows: bool = False,
        max_prompt_tokens: int | None = None,
        train_size: int = 1024,
        val_size: int = 128,
        train_split: str = "train",
        val_split: str = "test",
        seed: int = 0,
        field_map: dict[str, str] | None = None,
        instruction: str | None = None,
        conversational: bool = False,
        val_batch_size: int | None = None,
        allow_train_val_overlap: bool = False,
    ) -> None:
        super().__init__()
        check = FieldChecks("PromptDataModule", {
            "batch_size": batch_size, "num_workers": num_workers, "skip_invalid_rows": skip_invalid_rows,
            "max_prompt_tokens": max_prompt_tokens, "train_size": train_size, "val_size": val_size,
            "seed": seed, "conversational": conversational, "val_batch_size": val_batch_size,
            "allow_train_val_overlap": allow_train_val_overlap,
        })
        check.integer("batch_size", at_least=1)
        check.integer("val_batch_size", at_least=1, optional=True)
        check.integer("num_workers", at_least=0)
        check.boolean("skip_invalid_rows")
        check.integer("max_prompt_tokens", at_least=1, optional=True)
        check.integer("train_size", at_least=1)
        check.integer("val_size", at_least=1)
        check.seed("seed")
        check.boolean("conversational")
        check.boolean("allow_train_val_overlap")
        check.require("max_prompt_tokens", max_prompt_tokens is None or tokenizer is not None,
                      "None without a tokenizer to count tokens")
        self.sources = {"train": (train, train_split, train_size), "val": (val, val_split, val_size)}
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.val_batch_size = batch_size if val_batch_size is None else val_batch_size
        self.num_workers = num_workers
        self.system_prompt = system_prompt
        self.skip_invalid_rows = skip_invalid_rows
        self.max_prompt_tokens = max_prompt_tokens
        self.seed = seed
        self.field_map = dict(field_map or {})
        self.instruction = instruction
        self.conversational = conversational
        self.allow_train_val_overlap = allow_train_val_overlap
        self.datasets: dict[str, PromptDataset] = {}
        self.skipped: dict[str, dict[str, int]] = {}

    def setup(self, stage: str | None = None) -> None:
        if isinstance(self.tokenizer, (str, Path)):
            # Lazy: resolves built-in offline names (e.g. "smollm2-135m-instruct") too.
            from lightning_logra.models import load_tokenizer

            self.tokenizer = load_tokenizer(str(self.tokenizer))
        built = False
        for split, (source, hub_split, size) in self.sources.items():
            if source is not None and split not in self.datasets:
                self.datasets[split] = self._build(split, source, hub_split, size)
                built = True
        if built and "val" in self.datasets:
            self._check_held_out()

    def train_dataloader(self) -> DataLoader:
        return resumable_train_loader(self.datasets["train"], self.trainer, source=self.sources["train"][0],
                                      batch_size=self.batch_size, seed=self.seed, num_workers=self.num_workers,
                                      collate_fn=collate_prompts)

    def val_dataloader(self) -> DataLoader | list:
        if "val" not in self.datasets:
            return []  # no val source: Lightning skips validation
        return DataLoader(self.datasets["val"], batch_size=self.val_batch_size, num_workers=self.num_workers,
                          collate_fn=collate_prompts)

    def drop_long_prompts(self, max_tokens: int, tokenizer, reason: str) -> None:
        """Drop the set-up rows whose rendered prompt is longer than ``max_tokens`` tokens of
        ``tokenizer`` (counted as a rollout engine encodes it), counted in ``skipped`` with
        those over ``max_prompt_tokens``. ``reason`` says where the limit comes from, for the
        warning. A training module calls this at setup, e.g. for its model's positions."""
        for split, dataset in list(self.datasets.items()):
            lengths = [len(ids) for ids in tokenizer(dataset.prompt_texts)["input_ids"]]
            keep = [length <= max_tokens for length in lengths]
            too_long = keep.count(False)
            if not too_long:
                continue
            name = self.sources[split][0]
            if too_long == len(keep):
                raise ValueError(f"{name}: every {split} prompt is longer than {max_tokens} tokens ({reason}); "
                                 f"the shortest has {min(lengths)}")
            self.datasets[split] = PromptDataset(list(itertools.compress(dataset.prompt_texts, keep)),
                                                 list(itertools.compress(dataset.columns, keep)))
            self.skipped[split]["too_long"] += too_long
            rank_zero_warn(f"{name}: skipped {too_long} {split} prompts longer than {max_tokens} tokens ({reason})")

    def render_prompt(self, row: dict) -> str:
        """The text to generate from: the row's chat, with ``instruction`` and ``system_prompt``."""
        messages = self.prompt_messages(row)
        if self.tokenizer is not None and getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return "\n\n".join(message["content"] for message in messages)

    def prompt_messages(self, row: dict) -> list[dict]:
        """The row's chat before rendering: its messages with ``instruction`` and
        ``system_prompt`` (what multi-turn rollouts render anew with the tools' schemas)."""
        messages = with_instruction(_as_messages(_original_prompt(row)), self.instruction)
        if self.system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return messages

    def _build(self, split: str, source, hub_split: str, size: int) -> "PromptDataset":
        name = str(source)
        if name == "arithmetic" or name.startswith("arithmetic:"):
            spec = re.fullmatch(r"(?:([1-9]\d*)(?:x([2-9]|[1-9]\d+))?(\+)?)?", name.partition(":")[2])
            if spec is None:
                raise ValueError(f"{name!r}: write arithmetic:<max_digits>, arithmetic:<max_digits>x<terms> "
                                 "(terms >= 2), either followed by + for sums only, e.g. arithmetic:1, "
                                 "arithmetic:1x3 or arithmetic:2+")
            digits, terms, sums = spec.groups()
            rows = arithmetic_rows(size, self.seed, split=split, max_digits=int(digits or 2), terms=int(terms or 2),
                                   signs="+" if sums else "+-")
        elif name == "code" or name.startswith("code:"):
            level = name.partition(":")[2]
            if level not in ("", "1", "2"):
                raise ValueError(f"{name!r}: write code:<level>, level 1 or 2, e.g. code:1")
            rows = code_rows(size, self.seed, split=split, level=int(level or 1))
        elif name.startswith("reasoning_gym:"):
            rows = reasoning_gym_rows(name.removeprefix("reasoning_gym:"), size, self.seed, split=split)
        else:
            rows = read_rows(source, hub_split)
        if self.field_map:
            rows = [_renamed(row, self.field_map) for row in rows]
        valid, invalid = validate_rows(rows, name, skip_invalid_rows=self.skip_invalid_rows)
        prompts = [self.render_prompt(row) for row in valid]
        columns = [_columns(row, self.conversational) for row in valid]
        too_long = 0
        if self.max_prompt_tokens is not None:
            lengths = [len(ids) for ids in self.tokenizer(prompts, add_special_tokens=False)["input_ids"]]
            keep = [length <= self.max_prompt_tokens for length in lengths]
            prompts = list(itertools.compress(prompts, keep))
            columns = list(itertools.compress(columns, keep))
            too_long = keep.count(False)
        self.skipped[split] = {"invalid": invalid, "too_long": too_long}
        if invalid:
            rank_zero_warn(f"{name}: skipped {invalid} invalid rows")
        if too_long:
            rank_zero_warn(f"{name}: skipped {too_long} prompts longer than {self.max_prompt_tokens} tokens")
        if not prompts:
            raise ValueError(f"{name}: no usable rows for {split}")
        return PromptDataset(prompts, columns)

    def _check_held_out(self) -> None:
        """Refuse validation prompts that are training prompts too (see the class docstring),
        or warn with ``allow_train_val_overlap``."""
        train_prompts = {prompt_key(columns["prompt"]) for columns in self.datasets["train"].columns}
        shared = {}
        for columns in self.datasets["val"].columns:
            key = prompt_key(columns["prompt"])
            if key in train_prompts:
                shared.setdefault(key, columns["prompt"])
        if not shared:
            return
        train, val = self.sources["train"][0], self.sources["val"][0]
        overlap = f"{len(shared)} validation prompts of {val} are also training prompts of {train}"
        if self.allow_train_val_overlap:
            rank_zero_warn(f"{overlap}: validation measures them too (allow_train_val_overlap=True)")
            return
        examples = ", ".join(_shortened(repr(prompt)) for prompt in itertools.islice(shared.values(), 3))
        raise ValueError(f"{overlap}, e.g. {examples}: validation would measure prompts the policy trains on. "
                         "Hold them out of one split, or set allow_train_val_overlap=True to validate on them anyway")


def with_instruction(messages: list[dict], instruction: str | None, end: int | None = None) -> list[dict]:
    """A copy of ``messages`` with ``instruction`` appended to the last user message before
    position ``end`` (default: of them all); ``messages`` itself without an instruction."""
    if not instruction:
        return messages
    users = [index for index in range(len(messages) if end is None else end) if messages[index]["role"] == "user"]
    if not users:
        raise ValueError(f"instruction {instruction!r}: a prompt has no 'user' message to append it to")
    messages = list(messages)
    messages[users[-1]] = {**messages[users[-1]], "content": messages[users[-1]]["content"] + instruction}
    return messages


def _renamed(row, field_map: dict[str, str]):
    if not isinstance(row, dict):
        return row  # validate_rows reports it with its position
    return {field_map.get(key, key): value for key, value in row.items()}


def _original_prompt(row: dict) -> str | list[dict]:
    """A validated row's prompt as the dataset gives it: ``prompt`` (a string or messages),
    else its ``messages``; what reward functions receive as ``prompts``."""
    return row["messages"] if row.get("prompt") is None else row["prompt"]


def _as_messages(prompt: str | list[dict]) -> list[dict]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


def prompt_key(prompt: str | list[dict]) -> str:
    """The prompt as comparable text: its messages as JSON (a string prompt as one user message)."""
    return json.dumps(_as_messages(prompt), sort_keys=True, ensure_ascii=False, default=str)


def _shortened(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _columns(row: dict, conversational: bool) -> dict:
    """A validated row as a dataset item carries it: all its columns, ``prompt`` the
    original prompt (a string prompt as one user message when ``conversational``), ``answer``
    a string or None."""
    answer, prompt = row.get("answer"), _original_prompt(row)
    return {**row, "prompt": _as_messages(prompt) if conversational else prompt,
            "answer": None if answer is None else str(answer)}


class PromptDataset(Dataset):
    """Items ``{"prompt_text": str, "prompt": str | list[dict], "answer": str | None, ...}``:
    the rendered text and the row's columns (``columns[i]``, see ``_columns``)."""

    def __init__(self, prompt_texts: list[str], columns: list[dict]) -> None:
        if len(prompt_texts) != len(columns):
            raise ValueError(f"PromptDataset: {len(prompt_texts)} prompt texts for {len(columns)} rows")
        self.prompt_texts = prompt_texts
        self.columns = columns

    def __len__(self) -> int:
        return len(self.prompt_texts)

    def __getitem__(self, index: int) -> dict:
        return {**self.columns[index], "prompt_text": self.prompt_texts[index]}


BATCH_KEYS = ("prompt_text", "prompt", "answer")


def collate_prompts(items: list[dict]) -> dict[str, list]:
    """A dict of lists over the union of the items' keys (``prompt_text``, ``prompt`` and
    ``answer`` first and always present), None where an item lacks a key. Values stay as
    they are (no tensors): prompts may be message lists, columns anything."""
    keys = dict.fromkeys(BATCH_KEYS)
    for item in items:
        keys.update(dict.fromkeys(item))
    return {key: [item.get(key) for item in items] for key in keys}


def resumable_train_loader(dataset: Dataset, trainer, *, source, batch_size: int, seed: int, num_workers: int,
                           collate_fn) -> "ResumableLoader":
    """A ``ResumableLoader`` of full batches over a ``ResumableSampler`` of ``dataset`` (this
    rank's share; one rank without a trainer). ``ValueError`` naming ``source`` when a rank's
    share is smaller than one batch."""
    world_size, rank = (trainer.world_size, trainer.global_rank) if trainer else (1, 0)
    sampler = ResumableSampler(dataset, num_replicas=world_size, rank=rank, seed=seed)
    if sampler.num_samples < batch_size:
        raise ValueError(f"{source}: {len(dataset)} usable train rows make {sampler.num_samples} per rank on "
                         f"{world_size} rank(s), fewer than batch_size = {batch_size}: not one full batch to train on")
    return ResumableLoader(dataset, trainer=trainer, drop_last=True, batch_size=batch_size, sampler=sampler,
                           num_workers=num_workers, collate_fn=collate_fn)


class ResumableSampler(DistributedSampler):
    """A shuffling ``DistributedSampler`` (order fixed by ``seed`` and the epoch) that can start
    an epoch after its first ``consumed`` rows, counted over all ranks: the rest of the
    epoch's order is split across however many ranks there are now, so a run resumed on
    fewer or more ranks trains each row of the epoch once. Being a ``DistributedSampler``,
    Lightning uses it as is and calls its ``set_epoch``.
    """

    def __init__(self, dataset: Dataset, *, num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.consumed = 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.consumed = 0  # a new epoch starts from its beginning
        super().set_epoch(epoch)

    def remaining_per_rank(self) -> int:
        """This rank's share of the epoch's rows after ``consumed`` (what ``__iter__`` yields)."""
        return math.ceil(max(len(self.dataset) - self.consumed, 0) / self.num_replicas)

    def __iter__(self):
        # DistributedSampler's permutation and padding (repeating the first rows to a
        # multiple of the ranks), applied to what is left of the epoch.
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        remaining = torch.randperm(len(self.dataset), generator=generator).tolist()[self.consumed:]
        total = self.remaining_per_rank() * self.num_replicas
        while remaining and len(remaining) < total:
            remaining += remaining[: total - len(remaining)]
        return iter(remaining[self.rank : total : self.num_replicas])


class ResumableLoader(DataLoader):
    """A train loader that Lightning checkpoints with the fit loop (it has ``state_dict`` /
    ``load_state_dict``) and restores before iterating.

    The state is the epoch, how many of its rows all ranks together trained on, and
    Lightning's count of the epoch's batches (``batches``). Rows are counted from the
    Trainer's progress (batches whose training step finished), which unlike the loader's
    own count is not ahead by Lightning's prefetched batch. States of older versions,
    ``{"epoch", "start"}`` with ``start`` rows per rank, are read as written by as many
    ranks as there are now.
    """

    def __init__(self, dataset: Dataset, *, trainer, **kwargs) -> None:
        super().__init__(dataset, **kwargs)
        self.trainer = trainer
        # (epoch, rows, batches) the fit resumed from: the rows of the batches Lightning
        # counted before the resume were consumed on the ranks of the saved run.
        self.resumed_at = (0, 0, 0)

    def state_dict(self) -> dict[str, int]:
        if self.trainer is None:
            raise RuntimeError("the loader's position comes from a Lightning Trainer's progress; none is attached")
        epoch = self.trainer.current_epoch
        batches = self._batch_progress().processed
        resumed_epoch, rows, resumed_batches = self.resumed_at
        if resumed_epoch != epoch:
            rows, resumed_batches = 0, 0
        rows += (batches - resumed_batches) * self.batch_size * self.sampler.num_replicas
        return {"epoch": epoch, "rows": rows, "batches": batches}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if "rows" in state:
            rows, batches = state["rows"], state["batches"]
        else:
            rows, batches = state["start"] * self.sampler.num_replicas, state["start"] // self.batch_size
        self.sampler.set_epoch(state["epoch"])
        self.sampler.consumed = rows
        # Lightning ends the epoch after len(self) batches counting those it restored; on
        # another number of ranks the rows left make a different number of batches, so the
        # restored count becomes the batches this epoch would have had before them.
        done = len(self) - self.sampler.remaining_per_rank() // self.batch_size
        if self.trainer is not None:
            progress = self._batch_progress()
            for counter in ("ready", "started", "processed", "completed"):
                setattr(progress, counter, getattr(progress, counter) + done - batches)
        self.resumed_at = (state["epoch"], rows, done)

    def _batch_progress(self):
        return self.trainer.fit_loop.epoch_loop.batch_progress.current
