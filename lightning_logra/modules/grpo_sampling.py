"""How ``GRPOModule`` gets a step's scored rollouts: generated here (with dynamic sampling's
further rounds) or sampled ahead by a worker process (``rollout.max_staleness``), single
completions or tool conversations, scored by the reward functions; and the rollout engine
it generates with. A mixin: the attributes it reads are ``GRPOModule``'s."""

from __future__ import annotations

from dataclasses import replace

import lightning as L
import torch
from typing_extensions import override

from lightning_logra.core.reliability import memory_phase
from lightning_logra.hooks import ReportsLoGRASteps
from lightning_logra.modules.async_rollouts import AsyncRollouts, last_step, steps_done
from lightning_logra.modules.multi_turn import prompt_conversations
from lightning_logra.modules.prompt_checks import warn_if_unscored
from lightning_logra.rewards.runner import RewardScores
from lightning_logra.rl.collectives import any_rank
from lightning_logra.rl.metrics import PhaseClock
from lightning_logra.rl.sampling import (
    ScoredRollouts,
    draw_prompts,
    fill_informative_groups,
    overlong_penalty,
    sampling_seed,
    score_rollouts,
)
from lightning_logra.rollout.base import RolloutEngine, Rollouts
from lightning_logra.rollout.engines import build_engine
from lightning_logra.rollout.worker import RolloutWorker

# What shrinks each phase's memory, for the error an out-of-memory in it raises.
ROLLOUT_HINT = ("rollout.max_new_tokens, rollout.num_generations, prompts per step (data batch_size), "
                "rollout.gpu_memory_utilization (vLLM)")


class StopRolloutWorkerOnException(L.Callback):
    """Stops the module's rollout worker when a fit raises: Lightning then calls no module
    hook (``teardown`` runs only after a fit that ends), and the worker process would hold
    its copy of the model until the module is collected."""

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        pl_module.stop_rollout_worker()


class RolloutSampling:
    """``GRPOModule``'s rollouts, rewards and engine."""

    _engine: RolloutEngine | None
    _async: AsyncRollouts | None
    _staleness: int
    _warned_unscored: bool

    def _sample(self, batch: dict[str, list], phases: PhaseClock):
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

    def _generate_and_score(self, batch: dict[str, list], phases: PhaseClock) -> ScoredRollouts:
        config = self.rollout_config
        with memory_phase("rollout", ROLLOUT_HINT):
            rollouts = self._rollouts(batch, config.num_generations)
        phases.lap("generation")
        return self._score(batch, rollouts, phases)

    def _score(self, batch: dict[str, list], rollouts: Rollouts, phases: PhaseClock) -> ScoredRollouts:
        config = self.rollout_config
        scores, columns = score_rollouts(self.reward_runner, rollouts, batch, config.num_generations)
        self._warn_if_unscored(scores, columns)
        rewards = torch.tensor(scores.total, dtype=torch.float32, device=self.device)
        loss = self.loss_config
        if loss.overlong_buffer:
            lengths = rollouts.completion_mask.sum(dim=1).to(rewards.device)
            rewards = rewards + overlong_penalty(lengths, config.max_new_tokens, loss.overlong_buffer, loss.overlong_penalty)
        phases.lap("rewards")
        return ScoredRollouts(rollouts, columns, scores, rewards)

    # One-step-off-policy rollouts (rollout.max_staleness > 0; modules/async_rollouts.py) ----------
    def _sample_ahead(self, batch: dict[str, list], phases: PhaseClock) -> ScoredRollouts:
        """This step's rollouts from the worker process, which samples the next batches meanwhile;
        ``generation`` times the wait for them."""
        config, updates_per_step = self.rollout_config, self.batching.num_iterations * self.batching.mini_batches
        if self._async is None:
            self._async = AsyncRollouts(
                lambda: RolloutWorker(self._model_source, self.tokenizer, config, lora=self._lora,
                                      threads=config.worker_threads, seed=self.seed),
                max_staleness=config.max_staleness, num_generations=config.num_generations,
                full_sync_every=config.full_sync_every,
                seed_of=lambda index: sampling_seed(self.seed, index * updates_per_step, self.global_rank))
        index = steps_done(self.trainer)
        with memory_phase("rollout", ROLLOUT_HINT):
            rollouts, version = self._async.rollouts(batch, index=index, epoch=self.current_epoch,
                                                     loader=self.trainer.train_dataloader, policy=self.policy,
                                                     last_index=last_step(self.trainer, index, updates_per_step))
        self._staleness = index - version
        phases.lap("generation")
        return self._score(batch, rollouts, phases)

    def _sync_worker(self, updates: int) -> None:
        """Send the worker what this step changed; it then samples at version (steps done) + 1."""
        logra = isinstance(self.trainer.strategy, ReportsLoGRASteps)
        if logra and len(self._low_rank_updates) != updates:
            raise RuntimeError(f"{updates} LoGRA updates ran but {len(self._low_rank_updates)} reported their "
                               "low-rank form: the rollout worker cannot follow them")
        self._async.sync(self.policy, [u for step in self._low_rank_updates for u in step],
                         version=steps_done(self.trainer) + 1)

    def stop_rollout_worker(self) -> None:
        """Stop the worker process of ``rollout.max_staleness``, if one runs; a later step
        starts a new one."""
        if self._async is not None:
            self._async.close()
            self._async = None

    def teardown(self, stage: str) -> None:
        self.stop_rollout_worker()

    def configure_callbacks(self) -> list[L.Callback]:
        return [*super().configure_callbacks(), StopRolloutWorkerOnException()]

    def _rollouts(self, batch: dict[str, list], num_generations: int, **sampling) -> Rollouts:
        """The batch's samples: single completions, or with tools conversations."""
        if self.multi_turn is None:
            return self.engine.generate(batch["prompt_text"], num_generations=num_generations, **sampling)
        prompts, rows = prompt_conversations(batch, getattr(self._trainer, "datamodule", None))
        return self.multi_turn.generate(self.engine, prompts, rows, num_generations=num_generations, device=self.device,
                                        any_rank=lambda flag: any_rank(flag, self.device), **sampling)

    def _warn_if_unscored(self, scores: RewardScores, columns: dict[str, list]) -> None:
        if not self._warned_unscored:  # once: data that causes it causes it at every step
            self._warned_unscored = warn_if_unscored(scores, columns, self.reward_runner)

    def _more_prompts(self, round_: int, count: int) -> dict[str, list]:
        """Further prompts for dynamic sampling: a resumed run draws the same ones."""
        seed = sampling_seed(self.seed + 7_727 * round_, self.global_step, self.global_rank)
        return draw_prompts(self.trainer.train_dataloader, count, seed)

    # The rollout engine, built once the strategy has placed the model -----------------------
    @property
    def engine(self) -> RolloutEngine:
        """The engine of this process. With ``rollout.max_staleness > 0`` the training rollouts
        come from the worker's engine and this one only validates: the HF engine on the policy."""
        if self._engine is None:
            config = self.rollout_config
            if config.max_staleness:
                config = replace(config, engine="hf", weight_sync="full")
            self._engine = build_engine(config, self.policy, self.tokenizer, seed=self.seed)
        return self._engine
