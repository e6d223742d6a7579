"""Learned reward models as reward functions: a sequence classifier that scores prompt +
completion (TRL's ``reward_funcs`` given a model id), an ordinary reward source of
``RewardRunner``: weighted, logged per function, timed out and counted like the others. (The
generative judge, which needs a rollout engine, is ``rollout.judge.JudgeReward``.)

``RewardConfig.functions`` names one by a string without ``:`` (a Hugging Face folder or hub
id; an import path ``module:function`` always has one). It loads once, when the runner is
built, on ``RewardConfig.model_device`` in ``model_dtype``; a batch is scored under
``torch.no_grad`` in slices of ``model_batch_size`` texts, each right-padded (so that the
classifier reads its last real token) and cut at ``max_length`` tokens when set.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from lightning_logra.placement import inference_placement


class SequenceClassifierReward:
    """``AutoModelForSequenceClassification`` with one label as ``fn(completions, prompts)``:
    the reward of a sample is the logit of its text. The text is the chat template's rendering
    of the prompt's messages plus the completion as the assistant's turn (a conversational
    row, or any row when the tokenizer has a template), else the prompt string followed by the
    completion. Named ``reward_model_<folder or id's last part>`` in the metrics."""

    def __init__(self, source: str, *, device: str | torch.device | None = None, dtype: str | None = None,
                 batch_size: int = 16, max_length: int | None = None) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if batch_size < 1 or (max_length is not None and max_length < 1):
            raise ValueError(f"reward model {source!r}: batch_size and max_length must be >= 1, got {batch_size}, "
                             f"{max_length}")
        self.source = source
        self.__name__ = "reward_model_" + re.sub(r"\W+", "_", Path(source.rstrip("/")).name).strip("_").lower()
        self.device, self.dtype = inference_placement(device, dtype)
        self.batch_size, self.max_length = batch_size, max_length
        self.tokenizer = AutoTokenizer.from_pretrained(source)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(source, dtype=self.dtype).to(self.device).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"reward model {source!r} has {self.model.config.num_labels} labels; a reward model "
                             "scores each text with one (num_labels = 1)")
        self.model.config.pad_token_id = self.tokenizer.pad_token_id

    def weight_bytes(self) -> int:
        """Its weights' bytes on its device (``StepSettings.reward_model_bytes``)."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def texts(self, prompts: list, completions: list) -> list[str]:
        texts = []
        for prompt, completion in zip(prompts, completions):
            reply = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
            if isinstance(prompt, list) or self.tokenizer.chat_template is not None:
                messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
                if self.tokenizer.chat_template is not None:
                    texts.append(self.tokenizer.apply_chat_template(messages + reply, tokenize=False))
                    continue
                prompt = "".join(message["content"] for message in messages)
            texts.append(prompt + "".join(message["content"] for message in reply))
        return texts

    def __call__(self, completions: list, prompts: list, **columns) -> list[float]:
        texts = self.texts(prompts, completions)
        scores = []
        with torch.no_grad():
            for start in range(0, len(texts), self.batch_size):
                inputs = self.tokenizer(texts[start:start + self.batch_size], return_tensors="pt", padding=True,
                                        padding_side="right", truncation=self.max_length is not None,
                                        max_length=self.max_length, add_special_tokens=False).to(self.device)
                scores += self.model(**inputs).logits[:, 0].float().tolist()
        return scores
