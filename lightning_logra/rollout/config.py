"""The rollout's settings (``RolloutConfig``), the dataclass YAML's ``model.init_args.rollout`` fills in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from lightning_logra.core.validation import FieldChecks


@dataclass
class RolloutConfig:
    """Sampling settings. Rollout log-probs are those of the temperature-scaled, untruncated
    distribution, the one the trainer scores, whatever ``top_p``/``top_k`` sample from.

    ``dynamic_sampling`` (DAPO): groups whose rewards are all equal carry no signal; they are
    dropped and replaced by groups of further prompts, drawn from the training set, over at
    most ``max_sampling_rounds`` extra generation rounds (then the batch is filled up with
    dropped groups, and counted)."""

    engine: Literal["hf", "vllm"] = "hf"
    """Who generates: ``hf`` (the training model itself) or ``vllm``."""
    num_generations: int = 8
    """Completions sampled per prompt (the group of group-normalised advantages)."""
    max_new_tokens: int = 256
    """Most tokens per completion."""
    temperature: float = 1.0
    """Sampling temperature of the training rollouts (and of the trainer's log-probs)."""
    top_p: float = 1.0
    """Nucleus sampling of the training rollouts, in (0, 1]; 1: off (must be 1 with vLLM)."""
    top_k: int = 0
    """Top-k sampling of the training rollouts; 0: off (must be 0 with vLLM)."""
    dynamic_sampling: bool = False
    """(DAPO) Replace groups whose rewards are all equal by groups of further prompts."""
    max_sampling_rounds: int = 3
    """Extra generation rounds dynamic sampling may run per step."""
    val_temperature: float = 0.7
    """Sampling temperature of validation."""
    val_top_p: float = 0.7
    """Nucleus sampling of validation, in (0, 1]."""
    val_generations: int = 4
    """Samples per validation prompt: pass@1 and pass@n."""
    gpu_memory_utilization: float = 0.3
    """vLLM on GPU only: the fraction of GPU memory vLLM may take, in (0, 1]."""
    kv_cache_gib: float = 1.0
    """vLLM on CPU only: memory for its KV cache, in GiB."""
    weight_sync: Literal["full", "lowrank"] = "full"
    """vLLM only: ``lowrank`` sends each LoGRA update as (alpha D, seed of A) and a full copy
    every ``full_sync_every`` syncs; ``full`` sends every weight every time."""
    full_sync_every: int = 50
    """``weight_sync: lowrank``, and LoGRA with ``max_staleness > 0``: syncs between two full copies."""
    max_staleness: int = 0
    """Training steps by which the weights that sample a batch may lag the weights that train on it. 0: each batch is
    sampled by the trained weights in this process (synchronous). 1: a worker process samples the next batch while
    this one trains (one-step-off-policy; importance sampling corrects for it, ``loss.tis``); single-turn only."""
    worker_threads: int | None = None
    """``max_staleness > 0``: torch threads of the rollout worker process; None: torch's default."""

    def __post_init__(self) -> None:
        check = FieldChecks.of(self)
        check.choice("engine", ("hf", "vllm"))
        check.integer("num_generations", at_least=1)
        check.integer("max_new_tokens", at_least=1)
        check.number("temperature", above=0)
        check.number("top_p", above=0, at_most=1)
        check.integer("top_k", at_least=0)
        check.boolean("dynamic_sampling")
        check.integer("max_sampling_rounds", at_least=0)
        check.number("val_temperature", above=0)
        check.number("val_top_p", above=0, at_most=1)
        check.integer("val_generations", at_least=1)
        check.number("gpu_memory_utilization", above=0, at_most=1)
        check.number("kv_cache_gib", above=0)
        check.choice("weight_sync", ("full", "lowrank"))
        check.integer("full_sync_every", at_least=1)
        check.integer("max_staleness", at_least=0)
        check.integer("worker_threads", at_least=1, optional=True)
        check.require("max_staleness", self.max_staleness == 0 or not self.dynamic_sampling,
                      "0 with dynamic_sampling: its extra rounds are drawn when a batch's rewards are known")
        check.require("weight_sync", self.weight_sync == "full" or self.engine == "vllm",
                      "'full' unless engine='vllm': the HF engine generates with the training model itself "
                      "and syncs nothing")
        # vLLM's log-probs would be those of the truncated distribution, the trainer's of the full one.
        truncation = ("with engine='vllm' (its log-probs would be those of the truncated distribution, the "
                      "trainer's of the full one; val_top_p applies to validation only)")
        check.require("top_p", self.engine != "vllm" or self.top_p == 1, f"1.0 {truncation}")
        check.require("top_k", self.engine != "vllm" or self.top_k == 0, f"0 {truncation}")


# A plain dataclass, safe to rebuild: checkpoints that hold it as a hyper-parameter load
# under torch.load's default weights_only=True, as Lightning passes it; those written before
# it moved here name it lightning_logra.rl.config.RolloutConfig.
torch.serialization.add_safe_globals([RolloutConfig, (RolloutConfig, "lightning_logra.rl.config.RolloutConfig")])
