"""GRPOModule: RL post-training of a causal LM on verifiable tasks, one prompt batch a step.

    prompts -> rollouts (no grad) -> rewards (-> more prompts: dynamic sampling) -> advantages
    -> "old" log-probs (no grad, when there is more than one update)
    -> per update: micro-batched loss with manual_backward -> optimizer step
    -> weight sync

It knows nothing about LoGRA: under ``strategy="logra_fsdp"`` the optimizer step becomes a
LoGRA update; under any other strategy it is AdamW (dense, or LoRA adapters). Getting the
scored rollouts is ``grpo_sampling``'s, validation ``grpo_validation``'s.
"""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch
from transformers import AutoConfig
from torchmetrics import MeanMetric

from lightning_logra.core.reliability import memory_phase
from lightning_logra.core.reshard import reshard
from lightning_logra.core.validation import deprecated_attributes
from lightning_logra.data import PromptDataModule
from lightning_logra.hooks import ReportsLoGRASteps
from lightning_logra.models import build_model, load_tokenizer, model_source, with_lora
from lightning_logra.modules.arguments import DEPRECATED_ALIASES, check_arguments, config_groups, micro_batching
from lightning_logra.modules.completions import completion_table, log_completion_table
from lightning_logra.modules.async_rollouts import AsyncRollouts
from lightning_logra.modules.engines import step_low_rank_updates, sync_engine
from lightning_logra.modules.grpo_sampling import RolloutSampling
from lightning_logra.modules.grpo_validation import PassAtNValidation
from lightning_logra.modules.multi_turn import build_multi_turn
from lightning_logra.modules.prompt_checks import check_answer_column, check_tests_column, drop_prompts_past_positions
from lightning_logra.notices import quiet_eval_mode_notice_for_frozen, quiet_manual_optimization_checkpoint_notice
from lightning_logra.rewards.config import RewardConfig
from lightning_logra.rewards.runner import RewardRunner
from lightning_logra.rollout.config import RolloutConfig
from lightning_logra.rl.batch import BACKWARD_HINT, RolloutBatch, batch_logprobs, mini_batch_rows
from lightning_logra.rl.collectives import any_rank, gather_ranks
from lightning_logra.rl.config import (BatchingConfig, LoggingConfig, LoRAConfig, LossConfig, MultiTurnConfig,
                                       OptimizerConfig)
from lightning_logra.rl.advantages import NonFiniteRewards, RunningBaseline, group_advantages, length_scaled
from lightning_logra.rl.metrics import PassTotals, PhaseClock, step_metrics
from lightning_logra.rl.packing import check_packing
from lightning_logra.rl.step import optimizer_with_schedule, run_update
from lightning_logra.rl.step_kl import k3_sums, plan_draw
from lightning_logra.rl.sampling import ScoredRollouts, sampling_seed

MAX_EMPTY_UPDATES = 8  # updates in a row with no token to train on before the run stops


@deprecated_attributes(DEPRECATED_ALIASES)
class GRPOModule(RolloutSampling, PassAtNValidation, L.LightningModule):
    """GRPO / Dr. GRPO / REINFORCE-with-baseline on any Hugging Face causal LM.

    ``model`` is a hub id, a local folder, or the offline built-in
    ``"smollm2-135m-instruct"``. The tokenizer loads when the module is built; the weights
    in ``configure_model`` (under ``logra_fsdp``: built empty, sharded, then each rank reads
    its own rows from the safetensors files; call ``configure_model()`` yourself to read or
    change the weights before ``fit``). Batches are ``{"prompt_text": [...], "prompt": [...],
    "answer": [...], <other columns>: [...]}`` (see ``PromptDataModule``); reward functions
    follow TRL's ``fn(completions, **columns)``. Each rollout batch trains
    ``batching.num_iterations`` passes of ``batching.mini_batches`` optimizer steps
    (``max_steps`` counts optimizer steps), micro-batched by ``batching``.

    When the fit starts, a ``PromptDataModule``'s data is checked against the module: with
    the built-in math reward a split without any ``answer`` is refused, with the code reward
    a malformed row of ``tests`` is refused naming it, and prompts that leave fewer than
    ``rollout.max_new_tokens`` of the model's positions are dropped and counted
    (see ``lightning_logra.modules.prompt_checks``). A batch that no reward function scored
    warns once.

    Settings are checked when the module is built (``BatchingConfig.<field> = <value> is
    invalid: must be ...``, ``GRPOModule.<argument> = ...``). The groups' fields' old flat
    names (``micro_batch_size``, ``rewards``, ...: ``DEPRECATED_ALIASES``) still work as
    keyword arguments, YAML keys and attributes to read, each warning once.

    Args:
        loss: the loss and its options (``LossConfig``; default GRPO).
        rollout: sampling and the rollout engine (``RolloutConfig``).
        optimizer: AdamW and its schedule for dense and LoRA runs (``OptimizerConfig``); a
            LoGRA step ignores it unless ``logra.follow_lr_schedule`` is set.
        reward: the reward functions, their weights and timeouts (``RewardConfig``; default:
            the built-in math reward).
        batching: passes, mini-batches and micro-batches of each rollout batch, and the
            log-prob chunk (``BatchingConfig``).
        logging: tables of sampled completions and the per-step KL (``LoggingConfig``; default:
            neither).
        lora: train LoRA adapters of this shape (peft) instead of the full weights (dense or
            LoRA baseline); None trains the full weights.
        activation_checkpointing: recompute each decoder layer's activations in backward
            instead of keeping them.
        cache_dir: where the built-in model is converted once (else ``$LIGHTNING_LOGRA_CACHE``,
            else ``~/.cache/lightning_logra``).
        seed: base of the sampling seeds, derived per step and rank, so that a resumed run
            samples what the uninterrupted one did.
        tools: functions the model may call, as import paths ``"module:function"`` (or
            callables), TRL's ``tools=``: name, type hints and Google-style docstring make each
            one's schema. Rollouts become conversations (see ``multi_turn`` and the tools guide).
        environment_factory: TRL's: an import path of (or) a callable returning an object whose
            public methods are tools, with ``reset(**row)`` and optionally ``get_reward()``; one
            instance per rollout.
        multi_turn: turns, tool timeouts and the chat template of tool rollouts (``MultiTurnConfig``).
    """

    def __init__(
        self,
        model: str,
        loss: LossConfig | None = None,
        rollout: RolloutConfig | None = None,
        optimizer: OptimizerConfig | None = None,
        reward: RewardConfig | None = None,
        batching: BatchingConfig | None = None,
        logging: LoggingConfig | None = None,
        lora: LoRAConfig | None = None,
        activation_checkpointing: bool = True,
        cache_dir: str | None = None,
        seed: int = 0,
        tools: list[str] | None = None,
        environment_factory: str | None = None,
        multi_turn: MultiTurnConfig | None = None,
        # Deprecated (DEPRECATED_ALIASES): keyword arguments and YAML keys, None meaning not given.
        rewards: list[str] | None = None,
        reward_weights: list[float] | None = None,
        reward_timeout_s: float | None = None,
        reward_max_consecutive_timeouts: int | None = None,
        micro_batch_size: int | None = None,
        micro_batch_tokens: int | None = None,
        num_iterations: int | None = None,
        mini_batches: int | None = None,
        logprob_chunk_positions: int | None = None,
        logprob_chunk_size: int | None = None,
        log_completions_every: int | None = None,
        log_completions_count: int | None = None,
        log_val_completions: bool | None = None,
        measure_step_kl: bool | None = None,
    ) -> None:
        super().__init__()
        flat = {name: value for name, value in locals().items() if name in DEPRECATED_ALIASES}
        reward, batching, logging = config_groups(reward, batching, logging, flat)
        self.save_hyperparameters(ignore=list(DEPRECATED_ALIASES))  # the groups, as built above
        self.loss_config = loss or LossConfig()
        self.rollout_config = rollout or RolloutConfig()
        self.optimizer_config = optimizer or OptimizerConfig()
        check_arguments(self.loss_config, self.rollout_config, lora,
                        {"activation_checkpointing": activation_checkpointing, "seed": seed})
        self.reward, self.batching, self.logging = reward, batching, logging
        self._micro_batching = micro_batching(self.loss_config, self.rollout_config, batching)
        self.seed = seed
        self._val_tables: list[dict[str, list]] = []
        self.automatic_optimization = False

        # The tokenizer now (cheap; the data module and the CLI may need it), the weights in
        # configure_model: under logra_fsdp built empty there and filled shard by shard.
        self._model_source = model_source(model, cache_dir)
        self.tokenizer = load_tokenizer(self._model_source)
        # What setup checks the prompts against: the weights come later, in configure_model.
        self.model_config = AutoConfig.from_pretrained(self._model_source)
        self._activation_checkpointing = activation_checkpointing
        self.policy: torch.nn.Module | None = None
        self.reference: torch.nn.Module | None = None
        self._lora = lora
        if lora is not None:
            # Built now, in full, as before: peft draws the adapters from the global random
            # state at construction, so a seed gives the same adapters as it always did.
            self.policy = self._load(empty=False)
            self.policy = with_lora(self.policy, lora)

        self.multi_turn = build_multi_turn(tools, environment_factory, multi_turn or MultiTurnConfig(),
                                           self.rollout_config.max_new_tokens, self.tokenizer,
                                           getattr(self.model_config, "max_position_embeddings", None))
        if self.multi_turn is not None and self.rollout_config.max_staleness:
            raise ValueError(f"GRPOModule.rollout.max_staleness = {self.rollout_config.max_staleness} samples ahead in a "
                             "worker process, which runs single-turn rollouts only: tools and environments run here. "
                             "Set rollout.max_staleness: 0 for tool rollouts")
        self.reward_runner = RewardRunner(reward.functions, weights=reward.weights, timeout_s=reward.timeout_s,
                                          max_consecutive_timeouts=reward.max_consecutive_timeouts,
                                          model_options=reward.model_options())
        self.baseline = RunningBaseline(self.loss_config.baseline_weight, self.loss_config.failure_reward,
                                        self.loss_config.success_threshold)
        self.val_pass_at_1 = MeanMetric()
        self.val_pass_at_n = MeanMetric()
        self.val_kl_from_init = MeanMetric() if self.logging.kl_from_init else None
        # Tool calls per validation conversation; only tool rollouts have them (nor a model-summary row otherwise).
        self.val_tool_calls = MeanMetric() if self.multi_turn is not None else None
        self._engine = None
        self._async: AsyncRollouts | None = None  # rollout.max_staleness > 0: built at the first step
        self._staleness = 0
        self._empty_updates_in_a_row = 0
        self._warned_unscored = False
        self._low_rank_updates: list[list] = []

    def configure_model(self) -> None:
        """Build the policy (and the initial weights, frozen, when ``loss.kl_coef > 0`` or
        ``logging.kl_from_init``) once; later calls
        (fit, then validate) keep them. Under a meta-device context (``logra_fsdp`` runs
        this hook in one) they are built empty and the strategy fills each rank's own rows
        from the model's safetensors files after sharding; elsewhere they load in full."""
        empty = torch.get_default_device().type == "meta"
        if self.policy is None:
            self.policy = self._load(empty=empty)
        if self.reference is None and (self.loss_config.kl_coef > 0 or self.logging.kl_from_init):
            self.reference = self._load(empty=empty, train=False)
            self.reference.requires_grad_(False)

    def _load(self, *, empty: bool, train: bool = True) -> torch.nn.Module:
        return build_model(self._model_source, self.tokenizer, empty=empty, train=train,
                           activation_checkpointing=self._activation_checkpointing)

    # LoGRA hooks (lightning_logra.hooks; read by the logra_fsdp strategy, unused elsewhere) ---
    def logra_model(self) -> torch.nn.Module:
        return self.policy

    def logra_frozen_models(self) -> list[torch.nn.Module]:
        """The KL reference, which logra_fsdp keeps in the compute dtype and shards like the policy."""
        return [] if self.reference is None else [self.reference]

    def setup(self, stage: str) -> None:
        """Check a ``PromptDataModule``'s prompts against the rewards and the model (Lightning
        has set the data module up by now; its loaders are built after)."""
        data = self.trainer.datamodule
        if isinstance(data, PromptDataModule):
            check_answer_column(data, self.reward_runner)
            check_tests_column(data, self.reward_runner)
            drop_prompts_past_positions(data, self.model_config, self.tokenizer, self.rollout_config.max_new_tokens,
                                        0 if self.multi_turn is None else self.multi_turn.tool_prompt_tokens())

    def on_fit_start(self) -> None:
        """With ``batching.micro_batch_tokens``, refuse a policy whose packed log-probs differ
        from its padded ones (``check_packing``), once the strategy has placed and filled it.
        The frozen reference's eval mode is by design, and a checkpoint after the step is the
        resume point: Lightning's notices of either are dropped."""
        quiet_eval_mode_notice_for_frozen(self, [self.reference] if self.reference is not None else [])
        quiet_manual_optimization_checkpoint_notice()
        if self.batching.micro_batch_tokens is None:
            return
        check_packing(self.policy, any_rank=lambda flag: any_rank(flag, self.device))
        reshard(self.policy)  # no backward follows this forward (core/reshard.py)

    # Training ---------------------------------------------------------------------------
    def training_step(self, batch: dict[str, list], batch_idx: int) -> None:
        started, phases = time.perf_counter(), PhaseClock()
        first_step = self.global_step
        # Sampling randomness is derived from (seed, step, rank), not carried over from
        # earlier steps: a resumed run samples exactly what the uninterrupted one did.
        torch.manual_seed(sampling_seed(self.seed, self.global_step, self.global_rank))
        # Checked before anything is generated; dynamic sampling keeps the number of rows.
        mini_batches = mini_batch_rows(len(batch["prompt_text"]) * self.rollout_config.num_generations,
                                       self.rollout_config.num_generations, self.batching.mini_batches)
        if self.rollout_config.max_staleness:
            scored, sampling = self._sample_ahead(batch, phases), None
        else:
            scored, sampling = self._sample(batch, phases)
        advantages = self._advantages(scored.rewards)
        phases.lap("rewards")

        rollouts = scored.rollouts
        input_ids, attention_mask = rollouts.input_ids, rollouts.attention_mask
        mask = rollouts.completion_mask[:, 1:].bool()  # log-prob t scores token t + 1
        if self.loss_config.mask_truncated:
            mask = mask & rollouts.ended_with_eos[:, None]
        if self.loss_config.response_length_reference is not None:
            advantages = length_scaled(advantages, mask, self.loss_config.response_length_reference)
        rollout_batch = RolloutBatch(rollouts, mask, rollouts.rollout_logprobs[:, 1:], advantages)
        if self.reference is not None and self.loss_config.kl_coef > 0:
            with torch.no_grad(), memory_phase("backward", BACKWARD_HINT):
                rollout_batch.reference_logprobs = batch_logprobs(self.reference, input_ids, attention_mask,
                                                                  self._micro_batching)
            reshard(self.reference)  # its embeddings and head would stay whole all step (core/reshard.py)
            phases.lap("reference")
        if self.batching.num_iterations * self.batching.mini_batches > 1:
            # The PPO ratio's denominator: the weights that sampled, before the first update.
            with torch.no_grad(), memory_phase("backward", BACKWARD_HINT):
                rollout_batch.old_logprobs = batch_logprobs(self.policy, input_ids, attention_mask, self._micro_batching)
            phases.lap("old_logprobs")

        passes = PassTotals.zeros(self.device)
        for _ in range(self.batching.num_iterations):
            for rows in mini_batches:
                trained = self._update(rollout_batch, rows, passes, phases)
                if rollout_batch.old_logprobs is None:  # one update: its log-probs are those of the weights that sampled
                    rollout_batch.old_logprobs = trained
        if self._async is not None:
            self._sync_worker(passes.updates)
        else:
            sync_engine(self.engine, self.policy, self.rollout_config, passes.updates, self._low_rank_updates)
        self._low_rank_updates = []
        phases.lap("weight_sync")
        # The one update had no token to train on: no gap to measure.
        old_logprobs = rollout_batch.rollout_logprobs if rollout_batch.old_logprobs is None else rollout_batch.old_logprobs
        metrics = step_metrics(scored, mask, rollout_batch.rollout_logprobs, old_logprobs, passes,
                               num_generations=self.rollout_config.num_generations, phase_seconds=phases.seconds,
                               started=started, sampling=sampling)
        sync_bytes = (self._async or self.engine).last_sync_bytes
        if sync_bytes is not None:
            metrics["perf/weight_sync_bytes"] = float(sync_bytes)
        if self._async is not None:
            metrics["rollout/staleness"] = float(self._staleness)
        for key, value in metrics.items():
            self.log(key, value, on_step=True, prog_bar=key == "reward/mean", batch_size=1)
        self._log_completions(scored, first_step)

    def _update(self, batch: RolloutBatch, rows: slice, passes: PassTotals, phases: PhaseClock) -> torch.Tensor | None:
        """One optimizer step on the rollout rows ``rows`` (``rl.step.run_update``): under
        logra_fsdp the step is handed its inputs (``logra_inputs``) and returns its
        ``StepReport``. Returns the detached trainer log-probs of ``rows``, or None when no
        rank has a token to train on there (``loss.mask_truncated`` and every completion cut
        off): then nothing runs."""
        lowrank = self.rollout_config.weight_sync == "lowrank" or (
            self._async is not None and isinstance(self.trainer.strategy, ReportsLoGRASteps))
        draw = None
        if self.logging.step_kl:  # its tokens are drawn in the training forward, from the pre-step policy
            draw = plan_draw(batch, rows, count=self.logging.step_kl_rows,
                             generator=self._step_kl_generator(passes.updates))
        update = run_update(self.policy, self.optimizers(), batch, rows, self._micro_batching,
                            backward=self.manual_backward, passes=passes, world=self.trainer.world_size,
                            num_generations=self.rollout_config.num_generations,
                            logra=isinstance(self.trainer.strategy, ReportsLoGRASteps), record_low_rank=lowrank,
                            after_backward=lambda: phases.lap("forward_backward"),
                            draw_at=None if draw is None else draw.in_micro_batch)
        if update is None:
            self._count_empty_update(passes)
            return None
        if draw is not None:
            phases.move(draw.forward_seconds, "forward_backward", "step_kl")
        if lowrank:
            self._low_rank_updates.append(step_low_rank_updates(update.report, self.trainer.strategy))
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
        passes.updates += 1
        self._empty_updates_in_a_row = 0
        phases.lap("optimizer_step")  # under logra_fsdp the whole LoGRA update, split further in perf/logra_*
        if draw is not None:
            passes.add_step_kl(*k3_sums(self.policy, batch, draw, self._micro_batching))
            reshard(self.policy)  # as for the reference: no backward follows this forward
            phases.lap("step_kl")
        return update.trainer_logprobs

    def _step_kl_generator(self, update: int) -> torch.Generator:
        """``policy/step_kl``'s own draws (rows, fresh tokens): the training randomness is
        untouched, and a resumed run draws what the uninterrupted one did."""
        seed = sampling_seed(self.seed + 15_485_863 * (update + 1), self.global_step, self.global_rank)
        return torch.Generator(device=self.device).manual_seed(seed)

    def _count_empty_update(self, passes: PassTotals) -> None:
        """An update with nothing to train on is skipped and counted; a run of them means the
        settings leave nothing to learn from, and waiting longer would never reach max_steps."""
        passes.skipped_updates += 1
        self._empty_updates_in_a_row += 1
        if self._empty_updates_in_a_row >= MAX_EMPTY_UPDATES:
            raise RuntimeError(
                f"{self._empty_updates_in_a_row} updates in a row had no completion token to train on: with "
                "loss.mask_truncated every completion hit rollout.max_new_tokens "
                f"({self.rollout_config.max_new_tokens}); raise it, or turn mask_truncated off. With an "
                "environment_factory, no rollout may have started (tools/failed_rollouts; a warning says why)")

    def _log_completions(self, scored: ScoredRollouts, first_step: int) -> None:
        every = self.logging.completions_every
        training_step = first_step // (self.batching.num_iterations * self.batching.mini_batches)
        if every and training_step % every == 0 and self.global_rank == 0 and self.loggers:
            table = completion_table(scored, step=first_step, count=self.logging.completions_count)
            log_completion_table(self.loggers, table, step=first_step)

    def _advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        loss = self.loss_config
        try:
            if loss.type == "reinforce_baseline":
                # Every rank updates the running baseline with the same (gathered) rewards and
                # keeps the advantages of its own rows.
                everyone = self.baseline.advantages(gather_ranks(rewards))
                return everyone.view(-1, rewards.numel())[self.global_rank if everyone.numel() > rewards.numel() else 0]
            return group_advantages(rewards, self.rollout_config.num_generations, normalize_std=loss.type != "dr_grpo")
        except NonFiniteRewards as error:
            runner = self.reward_runner
            functions = ", ".join(f"{name!r} (weight {weight})" for name, weight in zip(runner.names, runner.weights))
            raise NonFiniteRewards(f"{error}: scale down the rewards of {functions}") from None

    # Optimizer: AdamW with linear warm-up and cosine decay (the paper's dense baseline) -------
    def configure_optimizers(self):
        """AdamW over the trainable parameters and its warm-up + cosine schedule
        (``rl.step``). Dense and LoRA runs step it. Under ``logra_fsdp`` it is the handle
        Lightning's optimizer steps go through, and LoGRA's update runs inside each: the
        strategy freezes the policy after building it (unless ``train_non_targets``, when it
        steps the non-targets), so it never sees a gradient and keeps no state; its schedule
        sets LoGRA's step size only when ``logra.follow_lr_schedule`` is on."""
        return optimizer_with_schedule(self.policy.parameters(), self.optimizer_config)

    # Checkpointed state beyond the weights -----------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["grpo_baseline"] = self.baseline.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "grpo_baseline" in checkpoint:
            self.baseline.load_state_dict(checkpoint["grpo_baseline"])

