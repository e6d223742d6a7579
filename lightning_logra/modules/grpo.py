"""GRPOModule: RL post-training of a causal LM on verifiable tasks, one prompt batch a step.

    prompts -> rollouts (no grad) -> rewards -> advantages -> trainer log-probs (no grad)
    -> micro-batched loss with manual_backward -> one optimizer step -> weight sync

It knows nothing about LoGRA: under ``strategy="logra_fsdp"`` the optimizer step becomes a
LoGRA update; under any other strategy it is AdamW (dense, or LoRA adapters).
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torchmetrics import MeanMetric

from lightning_logra.modules.config import LoRAConfig, LossConfig, OptimizerConfig, RolloutConfig
from lightning_logra.modules.logprobs import DEFAULT_CHUNK_SIZE, sequence_logprobs
from lightning_logra.modules.losses import (
    RunningBaseline,
    dr_grpo_loss,
    group_advantages,
    grpo_loss,
    reinforce_baseline_loss,
)
from lightning_logra.models import enable_activation_checkpointing, load_policy
from lightning_logra.reliability import memory_phase
from lightning_logra.rewards.runner import RewardRunner

DEFAULT_REWARD = "lightning_logra.rewards.math:math_reward"
# What shrinks each phase's memory, for the error an out-of-memory in it raises.
ROLLOUT_HINT = ("rollout.max_new_tokens, rollout.num_generations, prompts per step (data batch_size), "
                "rollout.gpu_memory_utilization (vLLM)")
BACKWARD_HINT = "micro_batch_size, activation_checkpointing=true, logprob_chunk_size"


class GRPOModule(L.LightningModule):
    """GRPO / Dr. GRPO / REINFORCE-with-baseline on any Hugging Face causal LM.

    ``model`` is a hub id, a local folder, or the offline built-in
    ``"smollm2-135m-instruct"``. Batches are ``{"prompt_text": [...], "answer": [...]}``
    (see ``PromptDataModule``). ``micro_batch_size`` rollouts go through each
    forward/backward; log-probs are computed in chunks of ``logprob_chunk_size`` positions,
    so full-vocabulary logits of a whole micro-batch never exist.
    """

    def __init__(
        self,
        model: str,
        loss: LossConfig | None = None,
        rollout: RolloutConfig | None = None,
        optimizer: OptimizerConfig | None = None,
        rewards: list[str] | None = None,
        reward_weights: list[float] | None = None,
        reward_timeout_s: float = 10.0,
        lora: LoRAConfig | None = None,
        micro_batch_size: int = 4,
        activation_checkpointing: bool = True,
        logprob_chunk_size: int = DEFAULT_CHUNK_SIZE,
        cache_dir: str | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.loss_config = loss or LossConfig()
        self.rollout_config = rollout or RolloutConfig()
        self.optimizer_config = optimizer or OptimizerConfig()
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size = {micro_batch_size} must be >= 1")
        if lora is not None and self.rollout_config.engine == "vllm":
            raise ValueError("rollout.engine='vllm' with lora is not supported: vLLM would need merged weights")
        self.micro_batch_size = micro_batch_size
        self.logprob_chunk_size = logprob_chunk_size
        self.seed = seed
        self.automatic_optimization = False

        self.policy, self.tokenizer = load_policy(model, cache_dir=cache_dir)
        self.policy.train()  # from_pretrained returns eval mode; Lightning keeps modes as found
        if activation_checkpointing:
            enable_activation_checkpointing(self.policy)
        if lora is not None:
            from peft import LoraConfig as PeftLoraConfig
            from peft import get_peft_model

            with warnings.catch_warnings():
                # peft asks transformers' deprecated `is_gradient_checkpointing`: not the user's to act on
                warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
                self.policy = get_peft_model(
                    self.policy,
                    PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules)),
                )
        self.reference = None
        if self.loss_config.kl_coef > 0:
            self.reference, _ = load_policy(model, cache_dir=cache_dir)
            self.reference.requires_grad_(False).eval()

        self.reward_runner = RewardRunner(rewards or [DEFAULT_REWARD], weights=reward_weights, timeout_s=reward_timeout_s)
        self.baseline = RunningBaseline(self.loss_config.baseline_weight, self.loss_config.failure_reward)
        self.val_pass_at_1 = MeanMetric()
        self.val_pass_at_n = MeanMetric()
        self._engine = None
        self._last: dict[str, torch.Tensor] = {}

    # LoGRA hooks (read by the logra_fsdp strategy once per step; harmless elsewhere) -------
    def logra_model(self) -> torch.nn.Module:
        return self.policy

    def logra_probe_batch(self) -> dict[str, torch.Tensor | float]:
        """The step's rollouts, scored at the positions that generated their tokens, at the
        sampling temperature. Rows come one per prompt first (then the second sample of
        each prompt, ...), so the probe's first responses answer different prompts."""
        n = self.rollout_config.num_generations
        rows = self._last["input_ids"].shape[0]
        order = torch.arange(rows, device=self._last["input_ids"].device).view(-1, n).T.reshape(-1)
        batch = {key: self._last[key][order] for key in ("input_ids", "attention_mask", "logits_mask", "position_ids")}
        return {**batch, "temperature": self.rollout_config.temperature}

    def logra_logprob_pairs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rollout vs trainer log-probs of the completion tokens of EOS-terminated responses."""
        return self._last["rollout_logprobs"], self._last["trainer_logprobs"], self._last["eos_mask"]

    # Training ---------------------------------------------------------------------------
    def training_step(self, batch: dict[str, list], batch_idx: int) -> None:
        config, started = self.rollout_config, time.perf_counter()
        phases = PhaseClock()
        # Sampling randomness is derived from (seed, step, rank), not carried over from
        # earlier steps: a resumed run samples exactly what the uninterrupted one did.
        torch.manual_seed(sampling_seed(self.seed, self.global_step, self.global_rank))
        with memory_phase("rollout", ROLLOUT_HINT):
            rollouts = self.engine.generate(batch["prompt_text"], num_generations=config.num_generations)
        phases.lap("generation")
        answers = [answer for answer in batch["answer"] for _ in range(config.num_generations)]
        scores, failures = self.reward_runner(rollouts.completion_text, answers)
        rewards = torch.tensor(scores, dtype=torch.float32, device=self.device)
        advantages = self._advantages(rewards)
        phases.lap("rewards")

        input_ids, attention_mask = rollouts.input_ids, rollouts.attention_mask
        mask = rollouts.completion_mask[:, 1:].bool()  # log-prob t scores token t + 1
        rollout_logprobs = rollouts.rollout_logprobs[:, 1:]
        reference_logprobs = None
        if self.reference is not None:
            with torch.no_grad(), memory_phase("backward", BACKWARD_HINT):
                reference_logprobs = self._logprobs(self.reference, input_ids, attention_mask)
            phases.lap("reference")

        rows, tokens = self._global_counts(mask)
        world = self.trainer.world_size
        optimizer = self.optimizers()
        optimizer.zero_grad()
        entropy_sum = torch.zeros((), device=self.device)
        stats_sum: dict[str, torch.Tensor] = {}
        trainer_parts = []
        for start in range(0, input_ids.shape[0], self.micro_batch_size):
            part = slice(start, start + self.micro_batch_size)
            with memory_phase("backward", BACKWARD_HINT):
                logprobs, entropy = self._logprobs(self.policy, input_ids[part], attention_mask[part], entropy=True)
            # One optimisation pass per rollout batch: the weights that sampled are the ones
            # computing now, so the "old" log-probs of the PPO ratio are these, detached.
            trainer_parts.append(logprobs.detach())
            loss, stats = self._loss(
                logprobs, trainer_parts[-1], rollout_logprobs[part], advantages[part], mask[part],
                None if reference_logprobs is None else reference_logprobs[part],
            )
            # Each part's loss is normalised over its own tokens (rows); reweight so that the
            # sum over parts and ranks is the batch-wide mean (data parallelism averages).
            weight = mask[part].sum() / tokens if self._per_token_normaliser else (logprobs.shape[0] / rows)
            with memory_phase("backward", BACKWARD_HINT):
                self.manual_backward(loss * weight * world)
            entropy_sum += (entropy.detach() * mask[part]).sum()
            for key, value in stats.items():
                stats_sum[key] = stats_sum.get(key, 0) + value * mask[part].sum()
        trainer_logprobs = torch.cat(trainer_parts)
        phases.lap("forward_backward")
        self._remember(rollouts, mask, rollout_logprobs, trainer_logprobs)  # read by the LoGRA strategy in step()
        optimizer.step()  # under logra_fsdp: the whole LoGRA update, split further in perf/logra_*
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
        phases.lap("optimizer_step")
        self.engine.sync_weights(self.policy)
        phases.lap("weight_sync")
        self._log_training(rewards, failures, rollouts, mask, trainer_logprobs, rollout_logprobs, entropy_sum, stats_sum, phases.seconds, started)

    @property
    def _per_token_normaliser(self) -> bool:
        return self.loss_config.type != "dr_grpo" and not (
            self.loss_config.type == "grpo" and self.loss_config.aggregation == "sequence"
        )

    def _advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        loss = self.loss_config
        if loss.type == "reinforce_baseline":
            # Every rank updates the running baseline with the same (gathered) rewards and
            # keeps the advantages of its own rows.
            everyone = self.baseline.advantages(self._gather(rewards))
            return everyone.view(-1, rewards.numel())[self.global_rank if everyone.numel() > rewards.numel() else 0]
        return group_advantages(rewards, self.rollout_config.num_generations, normalize_std=loss.type == "grpo")

    def _loss(self, logprobs, trainer_logprobs, rollout_logprobs, advantages, mask, reference_logprobs):
        loss = self.loss_config
        if loss.type == "reinforce_baseline":
            return reinforce_baseline_loss(logprobs, rollout_logprobs, advantages, mask, tis_cap=loss.tis_cap)
        common = dict(epsilon_low=loss.epsilon_low, epsilon_high=loss.epsilon_high, ref_logprobs=reference_logprobs, kl_coef=loss.kl_coef)
        if loss.type == "dr_grpo":
            return dr_grpo_loss(logprobs, trainer_logprobs, advantages, mask, max_completion_length=self.rollout_config.max_new_tokens, **common)
        return grpo_loss(logprobs, trainer_logprobs, advantages, mask, aggregation=loss.aggregation, **common)

    def _logprobs(self, model, input_ids, attention_mask, entropy: bool = False):
        """One call with grad (a micro-batch); micro-batched without (a whole rollout batch)."""
        if torch.is_grad_enabled():
            return sequence_logprobs(model, input_ids, attention_mask, temperature=self.rollout_config.temperature,
                                     chunk_size=self.logprob_chunk_size, return_entropy=entropy)
        parts = [
            sequence_logprobs(model, input_ids[s : s + self.micro_batch_size], attention_mask[s : s + self.micro_batch_size],
                              temperature=self.rollout_config.temperature, chunk_size=self.logprob_chunk_size)
            for s in range(0, input_ids.shape[0], self.micro_batch_size)
        ]
        return torch.cat(parts)

    def _remember(self, rollouts, mask, rollout_logprobs, trainer_logprobs) -> None:
        logits_mask = torch.zeros_like(rollouts.attention_mask, dtype=torch.bool)
        logits_mask[:, :-1] = mask
        self._last = {
            "input_ids": rollouts.input_ids,
            "attention_mask": rollouts.attention_mask,
            "logits_mask": logits_mask,
            "position_ids": (rollouts.attention_mask.long().cumsum(-1) - 1).clamp(min=0),
            "rollout_logprobs": rollout_logprobs,
            "trainer_logprobs": trainer_logprobs,
            "eos_mask": mask & rollouts.ended_with_eos[:, None],
        }

    # Validation: pass@1 and pass@n over n samples per prompt ----------------------------------
    def validation_step(self, batch: dict[str, list], batch_idx: int) -> None:
        config = self.rollout_config
        n = config.val_generations
        torch.manual_seed(sampling_seed(self.seed + 1, batch_idx, self.global_rank))
        rollouts = self.engine.generate(batch["prompt_text"], num_generations=n, temperature=config.val_temperature, top_p=config.val_top_p)
        answers = [answer for answer in batch["answer"] for _ in range(n)]
        scores, _ = self.reward_runner(rollouts.completion_text, answers)
        correct = (torch.tensor(scores, device=self.device) > 0).float().view(-1, n)
        self.val_pass_at_1.update(correct.mean(dim=1))
        self.val_pass_at_n.update(correct.amax(dim=1))  # unbiased pass@k with k = n
        self.log("val/pass_at_1", self.val_pass_at_1, on_epoch=True, prog_bar=True, batch_size=correct.shape[0])
        self.log(f"val/pass_at_{n}", self.val_pass_at_n, on_epoch=True, batch_size=correct.shape[0])

    # Optimizer: AdamW with linear warm-up and cosine decay (the paper's dense baseline) -------
    def configure_optimizers(self):
        config = self.optimizer_config
        parameters = [p for p in self.policy.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(parameters, lr=config.lr, betas=tuple(config.betas), weight_decay=config.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # Rollout engine, built once the strategy has placed the model -----------------------------
    @property
    def engine(self):
        if self._engine is None:
            config = self.rollout_config
            if config.engine == "vllm":
                from lightning_logra.rollout.vllm import VLLMRolloutEngine

                self._engine = VLLMRolloutEngine(
                    self._vllm_model_path(), max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                    top_p=config.top_p, gpu_memory_utilization=config.gpu_memory_utilization,
                )
                self._engine.sync_weights(self.policy)
            else:
                from lightning_logra.rollout.hf import HFRolloutEngine

                self._engine = HFRolloutEngine(
                    self.policy, self.tokenizer, max_new_tokens=config.max_new_tokens,
                    temperature=config.temperature, top_p=config.top_p,
                )
        return self._engine

    def _vllm_model_path(self) -> str:
        return getattr(self.policy, "name_or_path", None) or self.policy.config._name_or_path

    # Checkpointed state beyond the weights -----------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["grpo_baseline"] = self.baseline.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "grpo_baseline" in checkpoint:
            self.baseline.load_state_dict(checkpoint["grpo_baseline"])

    # Helpers ---------------------------------------------------------------------------------
    def _gather(self, values: torch.Tensor) -> torch.Tensor:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return values
        gathered = torch.empty(values.numel() * dist.get_world_size(), dtype=values.dtype, device=values.device)
        dist.all_gather_single(gathered, values.contiguous())
        return gathered

    def _global_counts(self, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = torch.stack([torch.tensor(float(mask.shape[0]), device=mask.device), mask.sum().float()])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts)
        return counts[0], counts[1]

    def _log_training(self, rewards, failures, rollouts, mask, trainer_logprobs, rollout_logprobs, entropy_sum, stats_sum, phase_seconds, started):
        n = self.rollout_config.num_generations
        lengths = rollouts.completion_mask.sum(dim=1).float()
        groups = rewards.view(-1, n)
        tokens = mask.sum()
        gap = torch.where(mask, rollout_logprobs - trainer_logprobs, 0.0)
        local = torch.stack([
            rewards.sum(), rewards.square().sum(), torch.tensor(float(rewards.numel()), device=self.device),
            (groups.std(dim=1, unbiased=False) == 0).float().sum(), torch.tensor(float(groups.shape[0]), device=self.device),
            lengths.sum(), (~rollouts.ended_with_eos).float().sum(), tokens.float(), entropy_sum,
            gap.sum(), gap.abs().sum(), torch.tensor(float(failures), device=self.device),
            *[stats_sum[key] for key in sorted(stats_sum)],
        ]).to(torch.float64)
        longest = lengths.max().clone()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(local)
            dist.all_reduce(longest, op=dist.ReduceOp.MAX)
        reward_sum, reward_square, count, zero_std, group_count, length_sum, truncated, token_count, entropy, gap_sum, gap_abs, failed, *extra = local.tolist()
        reward_mean = reward_sum / count
        metrics = {
            "reward/mean": reward_mean,
            "reward/std": math.sqrt(max(reward_square / count - reward_mean**2, 0.0)),
            "reward/zero_std_groups": zero_std / group_count,
            "reward/failures": failed,
            "completion/length_mean": length_sum / count,
            "completion/length_max": float(longest),
            "completion/clipped_fraction": truncated / count,
            "policy/entropy": entropy / token_count,
            "policy/rollout_trainer_logprob_gap": gap_sum / token_count,
            "policy/rollout_trainer_logprob_gap_abs": gap_abs / token_count,
            "perf/tokens_per_second": token_count / max(time.perf_counter() - started, 1e-9),
            **{f"perf/{phase}_s": seconds for phase, seconds in phase_seconds.items()},
        }
        for key, value in zip(sorted(stats_sum), extra):
            metrics[f"policy/{key}"] = value / token_count
        for key, value in metrics.items():
            self.log(key, value, on_step=True, prog_bar=key == "reward/mean", batch_size=1)


class PhaseClock:
    """Wall-clock seconds of the consecutive phases of one step (this rank's)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = now - self._last
        self._last = now


def sampling_seed(seed: int, step: int, rank: int) -> int:
    return (seed * 1_000_003 + step * 7_919 + rank * 104_729) % 2**63


def lr_factor(step: int, config: OptimizerConfig) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine to ``min_lr_ratio`` at ``decay_steps``."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.decay_steps <= config.warmup_steps:
        return 1.0
    progress = min((step - config.warmup_steps) / (config.decay_steps - config.warmup_steps), 1.0)
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
