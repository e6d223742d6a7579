"""Chat data for supervised fine-tuning (``SFTModule``): conversations tokenised the way the
multi-turn rollouts lay them out, with a mask of the tokens the model is trained to write.

A conversation is rendered once with the chat template and the tools' schemas (the same
``ToolChat`` the rollouts use, so an SFT'd model sees in RL exactly the prompt layout it was
fine-tuned on), then cut at its assistant turns: each turn's text from the end of its
``<|im_start|>assistant\\n`` header up to and including its end-of-turn token is trained; the
system prompt, the user turns, the tool results (``tool`` messages) and the headers are
context. The pieces are tokenised one by one, as a rollout's prompt, generated turns and
tool turns are, so no token straddles a trained and an untrained stretch. Whatever the
template writes after the last assistant turn is left out.

The built-in ``calculator`` source writes correct calculator-calling conversations for the
tool task (``configs/quickstart_tools.yaml``): a three-digit problem, one call with its
expression, the tool's result, the number. Its problems are drawn from the task's training
prompts only (``held_out``), so none is a validation prompt of the RL task, for any seed.
"""

from __future__ import annotations

from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, Dataset

from lightning_logra.core.validation import FieldChecks
from lightning_logra.data.datamodule import prompt_key, resumable_train_loader, with_instruction
from lightning_logra.data.sources import arithmetic_rows, read_rows
from lightning_logra.tools.calculator import calculator
from lightning_logra.tools.schema import load_tools, tool_schema
from lightning_logra.tools.template import ToolChat

ROLES = ("system", "user", "assistant", "tool")


def calculator_conversations(n: int, seed: int, *, split: str = "train", max_digits: int = 3) -> list[dict]:
    """``n`` conversations that solve ``arithmetic:<max_digits>`` problems of ``split`` with
    one correct calculator call: ``{"messages": [user, assistant call, tool result,
    assistant answer], "prompt": the problem, "answer": its value}``. The same for a
    (seed, split); the problems are those ``arithmetic_rows`` draws."""
    conversations = []
    for row in arithmetic_rows(n, seed, split=split, max_digits=max_digits):
        expression = row["prompt"].removeprefix("What is ").removesuffix("?")
        result = calculator(expression)
        if result != row["answer"]:  # the generator and the tool disagree: a bug, never data to train on
            raise AssertionError(f"calculator({expression!r}) = {result}, the task's answer is {row['answer']}")
        call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
        conversations.append({
            "messages": [
                {"role": "user", "content": row["prompt"]},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "calculator", "content": result},
                {"role": "assistant", "content": row["answer"]},
            ],
            "prompt": row["prompt"],
            "answer": row["answer"],
        })
    return conversations


def messages_problem(messages) -> str | None:
    """Why ``messages`` is not a conversation to fine-tune on (None when it is): a list of
    ``{"role", "content"}`` messages of the known roles, an assistant's content may be empty
    when it has ``tool_calls``, and at least one assistant turn after a first message that is
    not one."""
    if not isinstance(messages, list) or not messages:
        return "field 'messages' must be a non-empty list of messages"
    for position, message in enumerate(messages):
        where = f"field 'messages[{position}]'"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            return f"{where} needs a 'role', one of {', '.join(ROLES)}"
        content = message.get("content")
        calls = message.get("tool_calls")
        if calls is not None and (message["role"] != "assistant" or not isinstance(calls, list)):
            return f"{where}: 'tool_calls' must be a list, on an assistant message"
        if not isinstance(content, str) and not (content is None and calls):
            return f"{where} needs a string 'content'"
    if messages[0]["role"] == "assistant":
        return "the conversation starts with an assistant turn: there is no prompt for it to answer"
    if not any(message["role"] == "assistant" for message in messages):
        return "the conversation has no assistant turn to train on"
    return None


def conversation_tokens(chat: ToolChat, messages: list[dict], schemas: list[dict]) -> tuple[list[int], list[bool]]:
    """The conversation's tokens and, per token, whether it is trained (part of an assistant
    turn, its end-of-turn token included). ``ValueError`` when the template renders a turn
    differently once later messages follow it (its tokens could not be cut)."""
    end_of_turn = chat.tokenizer.convert_ids_to_tokens(chat.end_of_turn_id)
    full = chat.render(messages, schemas, add_generation_prompt=False)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = chat.render(messages[:index], schemas, add_generation_prompt=True)
        through = chat.render(messages[: index + 1], schemas, add_generation_prompt=False)
        if not (through.startswith(before) and full.startswith(through)):
            raise ValueError(f"the chat template renders the conversation before assistant turn {index} differently "
                             "once that turn follows: its tokens cannot be cut (set chat_template)")
        end = through.rfind(end_of_turn)
        if end < len(before):
            raise ValueError(f"the chat template ends assistant turn {index} without the end-of-turn token "
                             f"{end_of_turn!r}: the model would never learn to stop")
        spans.append((len(before), end + len(end_of_turn)))
    ids, trained, start = [], [], 0
    for span_start, span_end in spans:
        for text, is_trained in ((full[start:span_start], False), (full[span_start:span_end], True)):
            piece = chat.encode(text) if text else []
            ids += piece
            trained += [is_trained] * len(piece)
        start = span_end
    return ids, trained


class ConversationDataset(Dataset):
    """Items ``{"input_ids": LongTensor, "loss_mask": BoolTensor}`` of tokenised conversations."""

    def __init__(self, rows: list[tuple[list[int], list[bool]]], prompt_keys: list[str]) -> None:
        self.rows = rows
        self.prompt_keys = prompt_keys

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids, trained = self.rows[index]
        return {"input_ids": torch.tensor(ids, dtype=torch.long), "loss_mask": torch.tensor(trained, dtype=torch.bool)}


def collate_conversations(items: list[dict[str, torch.Tensor]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``loss_mask`` (False on padding)."""
    length = max(item["input_ids"].numel() for item in items)
    input_ids = torch.full((len(items), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(items), length), dtype=torch.long)
    loss_mask = torch.zeros((len(items), length), dtype=torch.bool)
    for row, item in enumerate(items):
        size = item["input_ids"].numel()
        input_ids[row, :size], attention_mask[row, :size], loss_mask[row, :size] = item["input_ids"], 1, item["loss_mask"]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


class ConversationDataModule(LightningDataModule):
    """Batches of ``batch_size`` tokenised conversations per step on each rank:
    ``{"input_ids", "attention_mask", "loss_mask"}`` (see ``conversation_tokens``).

    Rows are TRL's conversational format, ``{"messages": [...]}`` with assistant
    ``tool_calls`` and ``tool`` messages, from a ``.jsonl``/``.json``/``.parquet`` file or a
    Hugging Face dataset (``train_split``/``val_split``), or the built-in
    ``"calculator:<max_digits>"`` (``calculator_conversations``; 3 digits by default), whose
    ``train_size``/``val_size`` rows are drawn with ``seed`` from the arithmetic task's
    training and validation prompts respectively.

    ``tools`` (import paths, as ``GRPOModule``'s) put their schemas in the system prompt, and
    ``chat_template`` replaces the tokenizer's, as ``multi_turn.chat_template`` does for RL:
    fine-tune with the tools and template the RL run will use. ``instruction`` is appended to
    the last user message before the first assistant turn (the prompt), as
    ``PromptDataModule`` appends it to its prompts. Conversations longer than ``max_tokens``
    are dropped and counted; invalid rows raise naming the row, or with
    ``skip_invalid_rows`` are dropped and counted (``skipped``). Validation prompts that are
    training prompts refuse the run unless ``allow_train_val_overlap``.

    The training order is ``PromptDataModule``'s: a seeded shuffle per epoch split across
    ranks, full batches only, and its position is saved in checkpoints.

    Args:
        train: the training conversations: a file, a Hugging Face dataset name or ``"calculator:<max_digits>"``.
        val: the validation conversations (``val/loss``), from the same kinds of source; None: no validation.
        tokenizer: the tokenizer, or its hub id, folder or built-in name (loaded at setup).
        tools: import paths of the tools whose schemas the system prompt lists.
        chat_template: a Jinja chat template to use instead of the tokenizer's.
        instruction: text appended to each conversation's prompt.
        batch_size: conversations per training step on each rank.
        val_batch_size: conversations per validation batch on each rank (default ``batch_size``).
        train_size: rows the built-in source draws for training.
        val_size: rows the built-in source draws for validation.
        train_split: the Hugging Face dataset split to train on.
        val_split: the Hugging Face dataset split to validate on.
        seed: the training order's shuffle seed and the built-in source's draw.
        max_tokens: drop (and count) conversations longer than this many tokens; None keeps all.
        skip_invalid_rows: drop (and count) invalid rows instead of raising on the first one.
        allow_train_val_overlap: validate on prompts that are training prompts too, with a warning.
        num_workers: DataLoader worker processes.
    """

    def __init__(
        self,
        train: str | Path,
        val: str | Path | None = None,
        tokenizer=None,
        tools: list[str] | None = None,
        chat_template: str | None = None,
        instruction: str | None = None,
        batch_size: int = 8,
        val_batch_size: int | None = None,
        train_size: int = 512,
        val_size: int = 64,
        train_split: str = "train",
        val_split: str = "test",
        seed: int = 0,
        max_tokens: int | None = None,
        skip_invalid_rows: bool = False,
        allow_train_val_overlap: bool = False,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        check = FieldChecks("ConversationDataModule", {
            "batch_size": batch_size, "val_batch_size": val_batch_size, "train_size": train_size,
            "val_size": val_size, "seed": seed, "max_tokens": max_tokens, "skip_invalid_rows": skip_invalid_rows,
            "allow_train_val_overlap": allow_train_val_overlap, "num_workers": num_workers, "tokenizer": tokenizer,
        })
        check.integer("batch_size", at_least=1)
        check.integer("val_batch_size", at_least=1, optional=True)
        check.integer("train_size", at_least=1)
        check.integer("val_size", at_least=1)
        check.seed("seed")
        check.integer("max_tokens", at_least=2, optional=True)
        check.boolean("skip_invalid_rows")
        check.boolean("allow_train_val_overlap")
        check.integer("num_workers", at_least=0)
        check.require("tokenizer", tokenizer is not None,
                      "a tokenizer, or its hub id, folder or built-in name: conversations are tokenised at setup")
        self.sources = {"train": (train, train_split, train_size), "val": (val, val_split, val_size)}
        self.tokenizer = tokenizer
        self.tools = list(tools or [])
        self.chat_template = chat_template
        self.instruction = instruction
        self.batch_size = batch_size
        self.val_batch_size = batch_size if val_batch_size is None else val_batch_size
        self.seed = seed
        self.max_tokens = max_tokens
        self.skip_invalid_rows = skip_invalid_rows
        self.allow_train_val_overlap = allow_train_val_overlap
        self.num_workers = num_workers
        self.datasets: dict[str, ConversationDataset] = {}
        self.skipped: dict[str, dict[str, int]] = {}

    def setup(self, stage: str | None = None) -> None:
        if isinstance(self.tokenizer, (str, Path)):
            from lightning_logra.models import load_tokenizer  # lazy, as PromptDataModule's

            self.tokenizer = load_tokenizer(str(self.tokenizer))
        chat = ToolChat(self.tokenizer, self.chat_template)
        schemas = [tool_schema(tool) for tool in load_tools(self.tools)]
        for split, (source, hub_split, size) in self.sources.items():
            if source is not None and split not in self.datasets:
                self.datasets[split] = self._build(split, source, hub_split, size, chat, schemas)
        if "val" in self.datasets:
            self._check_held_out()

    def train_dataloader(self) -> DataLoader:
        return resumable_train_loader(self.datasets["train"], self.trainer, source=self.sources["train"][0],
                                      batch_size=self.batch_size, seed=self.seed, num_workers=self.num_workers,
                                      collate_fn=self._collate)

    def val_dataloader(self) -> DataLoader | list:
        if "val" not in self.datasets:
            return []
        return DataLoader(self.datasets["val"], batch_size=self.val_batch_size, num_workers=self.num_workers,
                          collate_fn=self._collate)

    def _collate(self, items: list[dict]) -> dict[str, torch.Tensor]:
        return collate_conversations(items, self.tokenizer.pad_token_id)

    def _rows(self, split: str, source, hub_split: str, size: int) -> list:
        name = str(source)
        if name == "calculator" or name.startswith("calculator:"):
            digits = name.partition(":")[2] or "3"
            if not digits.isdigit() or int(digits) < 1:
                raise ValueError(f"{name!r}: write calculator:<max_digits>, e.g. calculator:3")
            return calculator_conversations(size, self.seed, split=split, max_digits=int(digits))
        return read_rows(source, hub_split)

    def _build(self, split: str, source, hub_split: str, size: int, chat: ToolChat, schemas: list[dict]
               ) -> ConversationDataset:
        name = str(source)
        rows, keys = [], []
        invalid = too_long = 0
        for index, row in enumerate(self._rows(split, source, hub_split, size)):
            messages = row.get("messages") if isinstance(row, dict) else None
            problem = messages_problem(messages) if isinstance(row, dict) else \
                f"expected an object with 'messages', got {type(row).__name__}"
            if problem is None:
                first_answer = next(i for i, message in enumerate(messages) if message["role"] == "assistant")
                try:
                    messages = with_instruction(messages, self.instruction, end=first_answer)
                    tokens = conversation_tokens(chat, messages, schemas)
                except ValueError as error:
                    problem = str(error)
            if problem is not None:
                if not self.skip_invalid_rows:
                    raise ValueError(f"{name}: {split} row {index}: {problem}")
                invalid += 1
                continue
            if self.max_tokens is not None and len(tokens[0]) > self.max_tokens:
                too_long += 1
                continue
            rows.append(tokens)
            keys.append(prompt_key(messages[:first_answer]))  # the prompt: the messages before the first answer
        self.skipped[split] = {"invalid": invalid, "too_long": too_long}
        if invalid:
            rank_zero_warn(f"{name}: skipped {invalid} invalid {split} rows")
        if too_long:
            rank_zero_warn(f"{name}: skipped {too_long} {split} conversations longer than {self.max_tokens} tokens")
        if not rows:
            raise ValueError(f"{name}: no usable {split} conversations")
        trained = sum(sum(mask) for _, mask in rows)
        rank_zero_info(f"{name}: {len(rows)} {split} conversations, {sum(len(ids) for ids, _ in rows):,} tokens, "
                       f"{trained:,} of them trained (assistant turns)")
        return ConversationDataset(rows, keys)

    def _check_held_out(self) -> None:
        train = set(self.datasets["train"].prompt_keys)
        shared = sum(key in train for key in self.datasets["val"].prompt_keys)
        if not shared:
            return
        overlap = (f"{shared} validation conversations of {self.sources['val'][0]} start from a prompt of the "
                   f"training conversations of {self.sources['train'][0]}")
        if self.allow_train_val_overlap:
            rank_zero_warn(f"{overlap}: validation measures them too (allow_train_val_overlap=True)")
            return
        raise ValueError(f"{overlap}: validation would measure prompts the model trains on. Hold them out of one "
                         "split, or set allow_train_val_overlap=True")

