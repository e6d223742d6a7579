"""GRPOModule: RL post-training of a causal LM on verifiable tasks, one prompt batch a step.

    prompts -> rollouts (no grad) -> rewards (-> more prompts: dynamic sampling) -> advantages
    -> "old" log-probs (no grad, when there is more than one update)
    -> per update: micro-batched loss with manual_backward -> optimizer step
    -> weight sync

It knows nothing about LoGRA: under ``strategy="logra_fsdp"`` the optimizer step becomes a
LoGRA update; under any other strategy it is AdamW (dense, or LoRA adapters).
"""

from __future__ import annotations

import math
import time
from typing import Any

import lightning as L
import torch
from torchmetrics import MeanMetric

from lightning_logra.modules.collectives import any_rank, gather_ranks, global_counts
from lightning_logra.modules.completions import completion_table, log_completion_table
from lightning_logra.modules.config import LoRAConfig, LossConfig, OptimizerConfig, RolloutConfig
from lightning_logra.modules.logprobs import DEFAULT_CHUNK_SIZE, sequence_logprobs
from lightning_logra.modules.losses import RunningBaseline, group_advantages, micro_batch_loss, normalised_per_token
from lightning_logra.modules.metrics import PassTotals, PhaseClock, step_metrics
from lightning_logra.modules.sampling import (
    ScoredRollouts,
    draw_prompts,
    fill_informative_groups,
    overlong_penalty,
    sampling_seed,
    score_rollouts,
)
from lightning_logra.models import enable_activation_checkpointing, load_policy, with_lora
from lightning_logra.reliability import memory_phase
from lightning_logra.rewards.runner import RewardRunner

DEFAULT_REWARD = "lightning_logra.rewards.math:math_reward"
# What shrinks each phase's memory, for the error an out-of-memory in it raises.
ROLLOUT_HINT = ("rollout.max_new_tokens, rollout.num_generations, prompts per step (data batch_size), "
                "rollout.gpu_memory_utilization (vLLM)")
BACKWARD_HINT = "micro_batch_size, activation_checkpointing=true, logprob_chunk_size"
MAX_EMPTY_UPDATES = 8  # updates in a row with no token to train on before the run stops


class GRPOModule(L.LightningModule):
    """GRPO / Dr. GRPO / REINFORCE-with-baseline on any Hugging Face causal LM.

    ``model`` is a hub id, a local folder, or the offline built-in
    ``"smollm2-135m-instruct"``. Batches are ``{"prompt_text": [...], "prompt": [...],
    "answer": [...], <other columns>: [...]}`` (see ``PromptDataModule``); reward functions
    follow TRL's ``fn(completions, **columns)``. ``micro_batch_size`` rollouts go through each
    forward/backward; log-probs are computed in chunks of ``logprob_chunk_size`` positions,
    so full-vocabulary logits of a whole micro-batch never exist.

    Each rollout batch trains ``num_iterations`` passes of ``mini_batches`` optimizer steps
    (whole prompt groups per mini-batch; ``max_steps`` counts optimizer steps). Every
    ``log_completions_every`` training steps (0: never) ``log_completions_count`` samples go
    to the loggers as a table.
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
        num_iterations: int = 1,
        mini_batches: int = 1,
        log_completions_every: int = 0,
        log_completions_count: int = 8,
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
        for name, value, least in (("micro_batch_size", micro_batch_size, 1), ("num_iterations", num_iterations, 1),
                                   ("mini_batches", mini_batches, 1), ("log_completions_every", log_completions_every, 0),
                                   ("log_completions_count", log_completions_count, 1)):
            if not (isinstance(value, int) and value >= least):
                raise ValueError(f"{name} = {value!r} must be an integer >= {least}")
        if self.loss_config.overlong_buffer > self.rollout_config.max_new_tokens:
            raise ValueError(f"loss.overlong_buffer = {self.loss_config.overlong_buffer} must be <= "
                             f"rollout.max_new_tokens = {self.rollout_config.max_new_tokens}")
        if self.loss_config.type != "reinforce_baseline" and self.rollout_config.num_generations < 2:
            raise ValueError(f"loss.type = {self.loss_config.type!r} needs rollout.num_generations >= 2 (group advantages)")
        if lora is not None and self.rollout_config.engine == "vllm":
            raise ValueError("rollout.engine='vllm' with lora is not supported: vLLM would need merged weights")
        self.micro_batch_size = micro_batch_size
        self.num_iterations = num_iterations
        self.mini_batches = mini_batches
        self.log_completions_every = log_completions_every
        self.log_completions_count = log_completions_count
        self.logprob_chunk_size = logprob_chunk_size
        self.seed = seed
        self.automatic_optimization = False

        self.policy, self.tokenizer = load_policy(model, cache_dir=cache_dir)
        self.policy.train()  # from_pretrained returns eval mode; Lightning keeps modes as found
        if activation_checkpointing:
            enable_activation_checkpointing(self.policy)
        if lora is not None:
            self.policy = with_lora(self.policy, lora)
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
        self._empty_updates_in_a_row = 0
        self._low_rank_updates: list[list] = []

    # LoGRA hooks (read by the logra_fsdp strategy once per step; harmless elsewhere) -------
    def logra_model(self) -> torch.nn.Module:
        return self.policy

    def logra_frozen_models(self) -> list[torch.nn.Module]:
        """The KL reference, which logra_fsdp keeps in the compute dtype and shards like the policy."""
        return [] if self.reference is None else [self.reference]

    def logra_probe_batch(self) -> dict[str, torch.Tensor | float]:
        """The step's rollouts, scored at the positions that generated their tokens, at the
        sampling temperature. Rows come one per prompt first (then the second sample of
        each prompt, ...), so the probe's first responses answer different prompts."""
        n = self.rollout_config.num_generations
        rows = self._last["input_ids"].shape[0]
        order = torch.arange(rows, device=self._last["input_ids"].device).view(-1, n).T.reshape(-1)
        batch = {key: self._last[key][order] for key in ("input_ids", "attention_mask", "logits_mask", "position_ids")}
        return {**batch, "temperature": self.rollout_config.temperature}

    def logra_low_rank_sync(self) -> bool:
        """Whether LoGRA should hand over each update as (alpha D, seed): ``weight_sync: lowrank``."""
        return self.rollout_config.weight_sync == "lowrank"

    def logra_applied(self, updates: list) -> None:
        """The low-rank form of one LoGRA update (``[]`` when nothing changed), for the next sync."""
        self._low_rank_updates.append(updates)

    def logra_logprob_pairs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rollout vs trainer log-probs of the completion tokens of EOS-terminated responses."""
        return self._last["rollout_logprobs"], self._last["trainer_logprobs"], self._last["eos_mask"]

    # Training ---------------------------------------------------------------------------
    def training_step(self, batch: dict[str, list], batch_idx: int) -> None:
        started, phases = time.perf_counter(), PhaseClock()
        first_step = self.global_step
        # Sampling randomness is derived from (seed, step, rank), not carried over from
        # earlier steps: a resumed run samples exactly what the uninterrupted one did.
        torch.manual_seed(sampling_seed(self.seed, self.global_step, self.global_rank))
        # Checked before anything is generated; dynamic sampling keeps the number of rows.
        mini_batches = self._mini_batch_rows(len(batch["prompt_text"]) * self.rollout_config.num_generations)
        scored, sampling = self._sample(batch, phases)
        advantages = self._advantages(scored.rewards)
        phases.lap("rewards")

        rollouts = scored.rollouts
        input_ids, attention_mask = rollouts.input_ids, rollouts.attention_mask
        mask = rollouts.completion_mask[:, 1:].bool()  # log-prob t scores token t + 1
        if self.loss_config.mask_truncated:
            mask = mask & rollouts.ended_with_eos[:, None]
        rollout_logprobs = rollouts.rollout_logprobs[:, 1:]
        reference_logprobs = old_logprobs = None
        if self.reference is not None:
            with torch.no_grad(), memory_phase("backward", BACKWARD_HINT):
                reference_logprobs = self._logprobs(self.reference, input_ids, attention_mask)
            if hasattr(self.reference, "reshard"):
                # FSDP2 keeps a root module's gathered weights after a forward that no backward
                # follows; the reference's embeddings and head would stay whole all step.
                self.reference.reshard()
            phases.lap("reference")
        if self.num_iterations * self.mini_batches > 1:
            # The PPO ratio's denominator: the weights that sampled, before the first update.
            with torch.no_grad(), memory_phase("backward", BACKWARD_HINT):
                old_logprobs = self._logprobs(self.policy, input_ids, attention_mask)
            phases.lap("old_logprobs")

        passes = PassTotals.zeros(self.device)
        for _ in range(self.num_iterations):
            for rows in mini_batches:
                trained = self._update(rows, rollouts, mask, rollout_logprobs, advantages, old_logprobs, reference_logprobs,
                                       passes, phases)
                if old_logprobs is None:  # one update: its log-probs are those of the weights that sampled
                    old_logprobs = trained
        self._sync_engine(passes.updates)
        phases.lap("weight_sync")
        if old_logprobs is None:  # the one update had no token to train on: no gap to measure
            old_logprobs = rollout_logprobs
        metrics = step_metrics(scored, mask, rollout_logprobs, old_logprobs, passes,
                               num_generations=self.rollout_config.num_generations, phase_seconds=phases.seconds,
                               started=started, sampling=sampling)
        if getattr(self.engine, "last_sync_bytes", None) is not None:
            metrics["perf/weight_sync_bytes"] = float(self.engine.last_sync_bytes)
        for key, value in metrics.items():
            self.log(key, value, on_step=True, prog_bar=key == "reward/mean", batch_size=1)
        self._log_completions(scored, first_step)

    def _update(self, rows, rollouts, mask, rollout_logprobs, advantages, old_logprobs, reference_logprobs, passes, phases):
        """One optimizer step on the rollout rows ``rows``: micro-batched forward/backward,
        then ``optimizer.step()`` (under logra_fsdp the whole LoGRA update). Returns the
        detached trainer log-probs of ``rows``, or None when no rank has a token to train on
        there (``loss.mask_truncated`` and every completion cut off): then nothing runs."""
        input_ids, attention_mask = rollouts.input_ids, rollouts.attention_mask
        row_count, tokens = global_counts(mask[rows])
        if tokens == 0:
            self._count_empty_update(passes)
            return None
        world = self.trainer.world_size
        optimizer = self.optimizers()
        optimizer.zero_grad()
        parts = []
        for start in range(rows.start, rows.stop, self.micro_batch_size):
            part = slice(start, min(start + self.micro_batch_size, rows.stop))
            with memory_phase("backward", BACKWARD_HINT):
                logprobs, entropy = self._logprobs(self.policy, input_ids[part], attention_mask[part], entropy=True)
            parts.append(logprobs.detach())
            if not mask[part].any():
                # Every completion here is masked, but other micro-batches (ranks) train: a zero
                # loss keeps this backward, and FSDP2's collectives, in step with theirs.
                loss, stats, weight = torch.where(mask[part], logprobs, 0.0).sum(), {}, 0.0
            else:
                old = parts[-1] if old_logprobs is None else old_logprobs[part]
                loss, stats = micro_batch_loss(
                    self.loss_config, logprobs, old, rollout_logprobs[part], advantages[part], mask[part],
                    None if reference_logprobs is None else reference_logprobs[part],
                    max_completion_length=self.rollout_config.max_new_tokens, tis=self._tis)
                # Each part's loss is normalised over its own tokens (rows); reweight so that the sum
                # over parts and ranks is the update-wide mean (data parallelism averages).
                weight = mask[part].sum() / tokens if normalised_per_token(self.loss_config) else (logprobs.shape[0] / row_count)
            with memory_phase("backward", BACKWARD_HINT):
                self.manual_backward(loss * weight * world)
            passes.add(entropy, mask[part], stats)
        trained = torch.cat(parts)
        phases.lap("forward_backward")
        # Read by the LoGRA strategy in step(): the probe rows and the rollout/trainer pairs at
        # the weights that sampled.
        self._remember(rollouts, rows, mask, rollout_logprobs, trained if old_logprobs is None else old_logprobs[rows])
        optimizer.step()  # under logra_fsdp: the whole LoGRA update, split further in perf/logra_*
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
        passes.updates += 1
        self._empty_updates_in_a_row = 0
        phases.lap("optimizer_step")
        return trained

    def _count_empty_update(self, passes: PassTotals) -> None:
        """An update with nothing to train on is skipped and counted; a run of them means the
        settings leave nothing to learn from, and waiting longer would never reach max_steps."""
        passes.skipped_updates += 1
        self._empty_updates_in_a_row += 1
        if self._empty_updates_in_a_row >= MAX_EMPTY_UPDATES:
            raise RuntimeError(
                f"{self._empty_updates_in_a_row} updates in a row had no completion token to train on: with "
                "loss.mask_truncated every completion hit rollout.max_new_tokens "
                f"({self.rollout_config.max_new_tokens}); raise it, or turn mask_truncated off")

    def _sync_engine(self, updates: int) -> None:
        """Bring the rollout engine to the trained weights: in full, or with ``weight_sync:
        lowrank`` by the LoGRA updates of this step (every one must have reached us)."""
        if not self.logra_low_rank_sync():
            self.engine.sync_weights(self.policy)
            return
        received, self._low_rank_updates = self._low_rank_updates, []
        if len(received) != updates:
            raise ValueError(f"rollout.weight_sync='lowrank' needs every optimizer step to be a LoGRA update "
                             f"(strategy logra_fsdp); {updates} steps ran, {len(received)} reported one")
        self.engine.sync_weights(self.policy, low_rank_updates=[u for step in received for u in step])

    def _mini_batch_rows(self, rows: int) -> list[slice]:
        """Consecutive row ranges of whole prompt groups, one per optimizer step."""
        prompts = rows // self.rollout_config.num_generations
        if prompts % self.mini_batches:
            raise ValueError(f"mini_batches = {self.mini_batches} must divide the {prompts} prompts of a step on each "
                             "rank (the data module's batch_size)")
        size = rows // self.mini_batches
        return [slice(start, start + size) for start in range(0, rows, size)]

    def _sample(self, batch: dict[str, list], phases: "PhaseClock"):
        """The step's scored rollouts; with ``rollout.dynamic_sampling`` groups of equal
        rewards are replaced by groups of further prompts (see ``fill_informative_groups``)."""
        first = self._generate_and_score(batch, phases)
        config = self.rollout_config
        if not config.dynamic_sampling:
            return first, None
        prompts = len(batch["prompt_text"])
        return fill_informative_groups(
            first, lambda round_: self._generate_and_score(self._more_prompts(round_, prompts), phases),
            group_size=config.num_generations, max_rounds=config.max_sampling_rounds,
            pad_token_id=self.tokenizer.pad_token_id, any_rank=lambda flag: any_rank(flag, self.device),
        )

    def _generate_and_score(self, batch: dict[str, list], phases: "PhaseClock") -> ScoredRollouts:
        config = self.rollout_config
        with memory_phase("rollout", ROLLOUT_HINT):
            rollouts = self.engine.generate(batch["prompt_text"], num_generations=config.num_generations)
        phases.lap("generation")
        scores, columns = score_rollouts(self.reward_runner, rollouts, batch, config.num_generations)
        rewards = torch.tensor(scores.total, dtype=torch.float32, device=self.device)
        loss = self.loss_config
        if loss.overlong_buffer:
            lengths = rollouts.completion_mask.sum(dim=1).to(rewards.device)
            rewards = rewards + overlong_penalty(lengths, config.max_new_tokens, loss.overlong_buffer, loss.overlong_penalty)
        phases.lap("rewards")
        return ScoredRollouts(rollouts, columns, scores, rewards)

    def _more_prompts(self, round_: int, count: int) -> dict[str, list]:
        """Further prompts for dynamic sampling: a resumed run draws the same ones."""
        seed = sampling_seed(self.seed + 7_727 * round_, self.global_step, self.global_rank)
        return draw_prompts(self.trainer.train_dataloader, count, seed)

    def _log_completions(self, scored: ScoredRollouts, first_step: int) -> None:
        every = self.log_completions_every
        training_step = first_step // (self.num_iterations * self.mini_batches)
        if every and training_step % every == 0 and self.global_rank == 0 and self.loggers:
            table = completion_table(scored, step=first_step, count=self.log_completions_count)
            log_completion_table(self.loggers, table, step=first_step)

    @property
    def _tis(self) -> bool:
        """Truncated importance sampling in the clipped losses: as set, else with vLLM only."""
        return self.loss_config.tis if self.loss_config.tis is not None else self.rollout_config.engine == "vllm"

    def _advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        loss = self.loss_config
        if loss.type == "reinforce_baseline":
            # Every rank updates the running baseline with the same (gathered) rewards and
            # keeps the advantages of its own rows.
            everyone = self.baseline.advantages(gather_ranks(rewards))
            return everyone.view(-1, rewards.numel())[self.global_rank if everyone.numel() > rewards.numel() else 0]
        return group_advantages(rewards, self.rollout_config.num_generations, normalize_std=loss.type != "dr_grpo")

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

    def _remember(self, rollouts, rows: slice, mask, rollout_logprobs, trainer_logprobs) -> None:
        attention_mask = rollouts.attention_mask[rows]
        logits_mask = torch.zeros_like(attention_mask, dtype=torch.bool)
        logits_mask[:, :-1] = mask[rows]
        self._last = {
            "input_ids": rollouts.input_ids[rows],
            "attention_mask": attention_mask,
            "logits_mask": logits_mask,
            "position_ids": (attention_mask.long().cumsum(-1) - 1).clamp(min=0),
            "rollout_logprobs": rollout_logprobs[rows],
            "trainer_logprobs": trainer_logprobs,
            "eos_mask": mask[rows] & rollouts.ended_with_eos[rows, None],
        }

    # Validation: pass@1 and pass@n over n samples per prompt ----------------------------------
    def validation_step(self, batch: dict[str, list], batch_idx: int) -> None:
        config = self.rollout_config
        n = config.val_generations
        torch.manual_seed(sampling_seed(self.seed + 1, batch_idx, self.global_rank))
        rollouts = self.engine.generate(batch["prompt_text"], num_generations=n, temperature=config.val_temperature, top_p=config.val_top_p)
        scores, _ = score_rollouts(self.reward_runner, rollouts, batch, n)
        correct = (torch.tensor(scores.total, device=self.device) > 0).float().view(-1, n)
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
                    kv_cache_gib=config.kv_cache_gib, seed=self.seed, weight_sync=config.weight_sync,
                    full_sync_every=config.full_sync_every,
                )
                self._engine.sync_weights(self.policy)
            else:
                from lightning_logra.rollout.hf import HFRolloutEngine

                self._engine = HFRolloutEngine(
                    self.policy, self.tokenizer, max_new_tokens=config.max_new_tokens,
                    temperature=config.temperature, top_p=config.top_p, top_k=config.top_k,
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


def lr_factor(step: int, config: OptimizerConfig) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine to ``min_lr_ratio`` at ``decay_steps``."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.decay_steps <= config.warmup_steps:
        return 1.0
    progress = min((step - config.warmup_steps) / (config.decay_steps - config.warmup_steps), 1.0)
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
