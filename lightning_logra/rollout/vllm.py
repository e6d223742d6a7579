"""Rollouts with vLLM colocated on the training GPUs (``pip install lightning-logra[vllm]``).

Every rank runs its own in-process vLLM engine (``distributed_executor_backend=
"external_launcher"``) on the GPU it trains on. Sleep mode frees vLLM's memory while the
trainer runs: weights and KV cache wake up for ``sync_weights``/``generate`` and go back
to sleep after each generation.
"""

import torch
from torch import nn

from lightning_logra.projection import canonical_name
from lightning_logra.rollout.base import Rollouts, check_request, pack_rollouts


class VLLMRolloutEngine:
    """Samples with vLLM; log-probs are vLLM's ``processed_logprobs`` (after temperature).
    ``HFRolloutEngine`` and the trainer score the untruncated distribution; whether vLLM's
    processed log-probs include its top-p truncation is not yet verified on a running
    engine, so keep ``top_p = 1`` for training rollouts here. ``temperature=0`` is greedy.

    ``sleep_level=1`` offloads the weights to CPU memory while asleep; ``2`` discards them,
    so ``sync_weights`` must run before every ``generate`` (as it does in RL training).
    """

    def __init__(
        self,
        model_path: str,
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        gpu_memory_utilization: float = 0.3,
        dtype: str = "bfloat16",
        max_model_len: int | None = None,
        seed: int = 0,
        sleep_level: int = 1,
    ) -> None:
        try:
            import vllm
        except ImportError as error:
            raise ImportError(
                "VLLMRolloutEngine needs vLLM: `pip install lightning-logra[vllm]` (CUDA only); "
                "HFRolloutEngine works without it"
            ) from error
        if not torch.cuda.is_available():
            raise RuntimeError("VLLMRolloutEngine needs a CUDA GPU; use HFRolloutEngine on CPU")
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {sleep_level}")
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.llm = vllm.LLM(
            model=model_path,
            dtype=dtype,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            distributed_executor_backend="external_launcher",
            enable_sleep_mode=True,
            logprobs_mode="processed_logprobs",
            seed=seed + rank,  # each rank samples its own completions
        )
        self.sampling = dict(temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, logprobs=0)
        tokenizer = self.llm.get_tokenizer()
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.sleep_level = sleep_level
        self._sleep()

    def sync_weights(self, model: nn.Module) -> None:
        """Copy ``model``'s weights into vLLM, one full tensor at a time (FSDP2 DTensors are
        gathered with ``full_tensor()``, a collective: every rank must call this)."""
        if self._weights_asleep:
            self.llm.wake_up(tags=["weights"])
            self._weights_asleep = False
        for name, tensor in model.state_dict().items():
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            # vLLM expects the HF checkpoint names, without the components wrappers insert.
            self.llm.collective_rpc(_load_weight, args=(canonical_name(name), full.detach()))
            del full
        self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
        self._weights_current = True

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

        if self._weights_asleep:
            self.llm.wake_up(tags=["weights"])
            self._weights_asleep = False
        self.llm.wake_up(tags=["kv_cache"])
        try:
            overrides = {k: v for k, v in (("temperature", temperature), ("top_p", top_p)) if v is not None}
            sampling = SamplingParams(n=num_generations, **{**self.sampling, **overrides})
            outputs = self.llm.generate(prompts, sampling, use_tqdm=False)
        finally:
            self._sleep()
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
            device=torch.device("cuda", torch.cuda.current_device()),
        )

    def _sleep(self) -> None:
        self.llm.sleep(level=self.sleep_level)
        self._weights_asleep = True
        # Level 1 keeps a CPU copy of the weights; level 2 drops them.
        self._weights_current = self.sleep_level == 1


def _load_weight(worker, name: str, tensor: torch.Tensor) -> None:
    # Runs in vLLM's worker, which is this process under the external launcher.
    worker.model_runner.model.load_weights(weights=[(name, tensor)])
