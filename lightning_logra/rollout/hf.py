"""Rollouts with Hugging Face ``generate`` on the training model itself (no copy, no sync).

Fits small models and CPU runs: ``generate`` keeps every step's raw logits (``B x V`` per
generated token) until it returns. At scale use the vLLM engine.
"""

import torch
from torch import nn

from lightning_logra.core.lowrank import LowRankUpdate
from lightning_logra.core.reshard import reshard
from lightning_logra.rollout.base import Continuation, Rollouts, check_request, pack_rollouts


class HFRolloutEngine:
    """Samples ``num_generations`` completions per prompt with ``model.generate``.

    Log-probs: ``generate(output_logits=True)`` returns the raw logits of each step; the
    sampled token's log-prob is ``log_softmax(logits / temperature)`` over the whole
    vocabulary, also when ``top_p < 1`` or ``top_k > 0`` truncate what is sampled from. That
    is the distribution the trainer scores (``sequence_logprobs``), so the rollout/trainer
    ratio measures numerical mismatch only, as vLLM's and the trainer's do.

    Sampling knobs a model's ``generation_config`` may set (repetition penalty, typical-p,
    its own top-k) are switched off so that only the engine's settings shape the sampler.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        do_sample: bool = True,
    ) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {top_k}")
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token: set tokenizer.pad_token (e.g. to its eos token)")
        self.model = model
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.do_sample = do_sample
        self.eos_token_ids = _eos_token_ids(model, tokenizer)

    last_sync_bytes = None  # nothing is ever sent: the engine generates with the training model

    def sync_weights(self, model: nn.Module, low_rank_updates: list[LowRankUpdate] | None = None) -> None:
        """Nothing to do: the engine generates with the training model itself."""

    @torch.no_grad()
    def generate(
        self,
        prompts: list[str],
        *,
        num_generations: int = 1,
        temperature: float | None = None,
        top_p: float | None = None,
    ) -> Rollouts:
        """Sample; ``temperature``/``top_p`` override the engine's for this call (validation)."""
        check_request(prompts, num_generations)
        temperature = self.temperature if temperature is None else temperature
        top_p = self.top_p if top_p is None else top_p
        encoded = self.tokenizer(prompts, padding=True, padding_side="left", return_tensors="pt")
        input_ids = encoded["input_ids"].repeat_interleave(num_generations, dim=0).to(self.model.device)
        attention_mask = encoded["attention_mask"].repeat_interleave(num_generations, dim=0).to(self.model.device)
        completions, token_logprobs = self._sample(input_ids, attention_mask, self.max_new_tokens, temperature, top_p)
        return self._pack(input_ids, attention_mask, completions, token_logprobs)

    @torch.no_grad()
    def continue_tokens(self, token_ids: list[list[int]], max_new_tokens: list[int], *, temperature: float | None = None,
                        top_p: float | None = None) -> list[Continuation]:
        """One sample after each token list (left-padded together, generated as given), cut
        to its own ``max_new_tokens``."""
        temperature = self.temperature if temperature is None else temperature
        top_p = self.top_p if top_p is None else top_p
        width = max(len(ids) for ids in token_ids)
        input_ids = torch.full((len(token_ids), width), self.tokenizer.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros(len(token_ids), width, dtype=torch.long)
        for row, ids in enumerate(token_ids):
            input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, width - len(ids):] = 1
        device = self.model.device
        completions, token_logprobs = self._sample(input_ids.to(device), attention_mask.to(device), max(max_new_tokens),
                                                   temperature, top_p)
        is_eos = torch.isin(completions, torch.tensor(self.eos_token_ids, device=completions.device)).tolist()
        continuations = []
        for ids, logprobs, eos, limit in zip(completions.tolist(), token_logprobs.tolist(), is_eos, max_new_tokens):
            stop = eos.index(True) + 1 if True in eos[:limit] else limit
            continuations.append(Continuation(ids[:stop], logprobs[:stop], ended_with_eos=True in eos[:limit]))
        return continuations

    def _sample(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int, temperature: float,
                top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``generate`` on a left-padded batch: the generated tokens (padded after EOS) and
        their log-probs at ``temperature`` over the whole vocabulary."""
        sampling = {"temperature": temperature, "top_p": top_p, "top_k": self.top_k, "typical_p": 1.0}
        # Under FSDP2 every rank must run the same number of forward passes: generation
        # continues on every rank until all have finished.
        synced = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
        was_training = self.model.training
        self.model.eval()
        try:
            output = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=max_new_tokens,
                do_sample=self.do_sample,
                repetition_penalty=1.0,
                pad_token_id=self.tokenizer.pad_token_id,
                eos_token_id=self.eos_token_ids,
                return_dict_in_generate=True,
                output_logits=True,
                synced_gpus=synced,
                **(sampling if self.do_sample else {}),
            )
        finally:
            self.model.train(was_training)
            reshard(self.model)  # FSDP2 would keep the root's gathered weights until the next backward
        completions = output.sequences[:, input_ids.shape[1] :]
        token_logprobs = torch.stack(
            [
                torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, completions[:, step, None]).squeeze(-1)
                for step, logits in enumerate(output.logits)
            ],
            dim=1,
        )
        return completions, token_logprobs

    def _pack(self, input_ids, attention_mask, completions, token_logprobs) -> Rollouts:
        is_eos = torch.isin(completions, torch.tensor(self.eos_token_ids, device=completions.device))
        ended_with_eos = is_eos.any(dim=1)
        # Generated length: up to and including the first EOS; generate pads after it.
        lengths = torch.where(ended_with_eos, is_eos.int().argmax(dim=1) + 1, completions.shape[1]).tolist()
        completion_ids = [row[:n].tolist() for row, n in zip(completions, lengths)]
        return pack_rollouts(
            prompt_ids=[row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask)],
            completion_ids=completion_ids,
            completion_logprobs=[row[:n].tolist() for row, n in zip(token_logprobs, lengths)],
            completion_text=self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True),
            ended_with_eos=ended_with_eos.tolist(),
            pad_token_id=self.tokenizer.pad_token_id,
            device=input_ids.device,
        )


def _eos_token_ids(model: nn.Module, tokenizer) -> list[int]:
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    configured = [] if configured is None else [configured] if isinstance(configured, int) else list(configured)
    ids = sorted({*configured, *([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])})
    if not ids:
        raise ValueError("neither the tokenizer nor the model's generation_config names an EOS token")
    return ids
