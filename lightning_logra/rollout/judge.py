"""A generative judge as a reward function: a causal LM asked for a verdict on each sample,
generated greedily by the HF or the vLLM rollout engine and parsed; an ordinary reward source of
``RewardRunner`` (weighted, logged per function, timed out and counted like the others),
given to ``RewardConfig.functions`` as an instance (in YAML: ``class_path`` and
``init_args``). The learned scorer, a sequence classifier, is ``rewards.models``'s.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from lightning_logra.models import model_source
from lightning_logra.placement import inference_placement
from lightning_logra.rollout.hf import HFRolloutEngine


class JudgeReward:
    """A generative judge as ``fn(completions, prompts, **columns)``: a causal LM (folder or
    hub id) is asked ``template`` as a user turn of its chat template, formatted with the
    sample's ``prompt``, ``completion`` and any of the row's columns (e.g. ``{answer}``), and
    answers greedily in at most ``max_new_tokens`` tokens; the reward is the value in
    ``verdicts`` of the first of its words (case-insensitive, whole words) that the answer
    contains. An answer with none of them scores None: unscored, counted in
    ``reward/unscored`` like any function's None. Named ``judge_<folder or id's last part>``.

    It generates greedily with ``HFRolloutEngine`` (``do_sample=False``) or ``VLLMRolloutEngine``
    (``engine="vllm"``, temperature 0). Under several processes each
    rank runs its own copy on its own rows; the engine keeps the ranks' ``generate`` calls in
    step, so every rank must score as many batches (as ``GRPOModule`` does)."""

    def __init__(self, source: str, template: str, verdicts: dict[str, float] | None = None, *,
                 device: str | torch.device | None = None, dtype: str | None = None, batch_size: int = 16,
                 max_new_tokens: int = 8, engine: str = "hf", kv_cache_gib: float = 0.5,
                 gpu_memory_utilization: float = 0.2) -> None:
        """
        Args:
            source: the judge's Hugging Face folder, hub id or built-in model name.
            template: the question, with ``{completion}`` and optionally ``{prompt}`` and row columns.
            verdicts: words the answer may give and their rewards; default ``{"yes": 1.0, "no": 0.0}``.
            device: where it runs; None: the current GPU, else the CPU.
            dtype: ``float32``, ``bfloat16`` or ``float16``; None: bfloat16 on a GPU, float32 on a CPU.
            batch_size: questions per ``generate`` call.
            max_new_tokens: the most tokens an answer may take.
            engine: ``hf`` (the HF engine on ``device``) or ``vllm`` (vLLM at temperature 0, on the GPU
                where there is one: ``gpu_memory_utilization`` of it; else on the CPU with ``kv_cache_gib``).
        """
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        verdicts = {"yes": 1.0, "no": 0.0} if verdicts is None else verdicts
        if not verdicts or not all(re.fullmatch(r"\w+", word) for word in verdicts):
            raise ValueError(f"judge {source!r}: verdicts must map words to rewards, got {verdicts!r}")
        if "{completion}" not in template:
            raise ValueError(f"judge {source!r}: the template must show the judge the {{completion}}")
        if batch_size < 1:
            raise ValueError(f"judge {source!r}: batch_size must be >= 1, got {batch_size}")
        if engine not in ("hf", "vllm"):
            raise ValueError(f"judge {source!r}: engine must be 'hf' or 'vllm', got {engine!r}")
        self.arguments = (source, template, verdicts, device if device is None else str(device), dtype, batch_size,
                          max_new_tokens, engine, kv_cache_gib, gpu_memory_utilization)
        self.source, self.template, self.batch_size = source, template, batch_size
        self.verdicts = {word.lower(): float(value) for word, value in verdicts.items()}
        self.pattern = re.compile(r"\b(" + "|".join(map(re.escape, self.verdicts)) + r")\b", re.IGNORECASE)
        self.__name__ = "judge_" + re.sub(r"\W+", "_", Path(source.rstrip("/")).name).strip("_").lower()
        self.device, self.dtype = inference_placement(device, dtype)
        folder = model_source(source)  # a built-in name too
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if engine == "vllm":
            from lightning_logra.rollout.vllm import VLLMRolloutEngine

            self.engine = VLLMRolloutEngine(folder, max_new_tokens=max_new_tokens, temperature=0.0,
                                            dtype=str(self.dtype).removeprefix("torch."), kv_cache_gib=kv_cache_gib,
                                            gpu_memory_utilization=gpu_memory_utilization)
            with torch.device("meta"):
                shapes = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
            self._weight_bytes = sum(p.numel() for p in shapes.parameters()) * self.dtype.itemsize
        else:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=self.dtype).to(self.device).eval()
            self.engine = HFRolloutEngine(model, self.tokenizer, max_new_tokens=max_new_tokens, do_sample=False)
            self._weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    def __reduce__(self):
        # Pickled (a checkpoint's hyper-parameters hold the reward config) as its arguments,
        # not its weights: loading rebuilds it, also under torch.load(weights_only=True).
        return rebuild_judge, self.arguments

    def weight_bytes(self) -> int:
        """Its weights' bytes on its device (``StepSettings.reward_model_bytes``; vLLM's KV cache not included)."""
        return self._weight_bytes

    def questions(self, prompts: list, completions: list, columns: dict[str, list]) -> list[str]:
        questions = []
        for index, (prompt, completion) in enumerate(zip(prompts, completions)):
            if isinstance(prompt, list):
                prompt = "\n".join(message["content"] for message in prompt)
            if isinstance(completion, list):
                completion = "\n".join(message["content"] for message in completion)
            row = {name: values[index] for name, values in columns.items()}
            text = self.template.format(**{**row, "prompt": prompt, "completion": completion})
            messages = [{"role": "user", "content": text}]
            questions.append(self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                             if self.tokenizer.chat_template is not None else text)
        return questions

    def verdict(self, answer: str) -> float | None:
        found = self.pattern.search(answer)
        return None if found is None else self.verdicts[found.group(1).lower()]

    def __call__(self, completions: list, prompts: list, **columns) -> list[float | None]:
        questions = self.questions(prompts, completions, columns)
        answers = []
        for start in range(0, len(questions), self.batch_size):
            answers += self.engine.generate(questions[start:start + self.batch_size]).completion_text
        return [self.verdict(answer) for answer in answers]


def rebuild_judge(source: str, template: str, verdicts: dict[str, float], device: str | None, dtype: str | None,
                  batch_size: int, max_new_tokens: int, engine: str = "hf", kv_cache_gib: float = 0.5,
                  gpu_memory_utilization: float = 0.2) -> JudgeReward:
    return JudgeReward(source, template, verdicts, device=device, dtype=dtype, batch_size=batch_size,
                       max_new_tokens=max_new_tokens, engine=engine, kv_cache_gib=kv_cache_gib,
                       gpu_memory_utilization=gpu_memory_utilization)


torch.serialization.add_safe_globals([rebuild_judge])
